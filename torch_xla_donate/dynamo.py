"""torch.compile(backend="openxla"): placeholder, filled in below."""
TRAMPOLINES = ()


def install():
    pass


def uninstall():
    pass
