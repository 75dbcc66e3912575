"""How long the sentences of a Markdown page are.

    python tools/prose_stats.py [README.md ...] [--long N] [--show]

Prose is what is left outside fenced and indented code, tables, headings,
images and HTML comments.  Paragraphs and list items are joined into text,
the words of an inline code span count, and a sentence ends at ``.``, ``!``
or ``?`` before white space, or at the end of its paragraph or item.
Prints per file: sentences, mean words per sentence, and how many have more
than ``--long`` (45) words; ``--show`` lists those.
"""
import argparse
import re
import sys

_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")
_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[A-Za-z0-9`*(\"'\[])")


def paragraphs(text: str) -> list:
    """The prose paragraphs (and list items) of a Markdown text."""
    out, cur, fence, comment = [], [], False, False

    def flush():
        if cur:
            out.append(" ".join(cur))
            cur.clear()

    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = not fence
            flush()
            continue
        if fence:
            continue
        if comment or stripped.startswith("<!--"):
            comment = "-->" not in stripped
            flush()
            continue
        if (not stripped or stripped.startswith(("|", "#", "![")) or
                (line.startswith("    ") and not cur and not _ITEM.match(line))):
            flush()
            continue
        if _ITEM.match(line):
            flush()
            line = _ITEM.sub("", line)
        cur.append(line.strip())
    flush()
    return out


def sentences(paragraph: str) -> list:
    # A code span counts its words, and its dots end no sentence.
    text = re.sub(r"`([^`]*)`", lambda m: "`" + re.sub(r"[.!?]", "_", m.group(1)) + "`", paragraph)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)   # a link is its text
    text = re.sub(r"\b(e\.g|i\.e|vs|etc|cf)\.", r"\1", text)
    return [s for s in _END.split(text) if re.search(r"\w", s)]


def words(sentence: str) -> int:
    return len([w for w in sentence.split() if re.search(r"\w", w)])


def stats(text: str, long: int = 45) -> dict:
    found = [s for p in paragraphs(text) for s in sentences(p)]
    counts = [words(s) for s in found]
    return {"sentences": len(found),
            "mean": sum(counts) / len(counts) if counts else 0.0,
            "long": [s for s, n in zip(found, counts) if n > long]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", default=["README.md"])
    parser.add_argument("--long", type=int, default=45)
    parser.add_argument("--show", action="store_true", help="list the long sentences")
    args = parser.parse_args(argv)
    for name in args.files:
        with open(name) as f:
            s = stats(f.read(), args.long)
        print(f"{name}: {s['sentences']} sentences, {s['mean']:.1f} words on average, "
              f"{len(s['long'])} over {args.long} words")
        if args.show:
            for sentence in s["long"]:
                print(f"  ({words(sentence)}) {sentence}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
