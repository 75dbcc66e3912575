// See record_tag.h.  Compiled like tensor_facts.cpp, with torch's include
// path and ABI flag.
#include "outcomes/record_tag.h"

#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <exception>
#include <utility>

#include "base/block_pool.h"

namespace torch_xla_donate {
namespace {

// A TensorImpl may be freed on any thread, without the GIL: the tag holds the
// C++ record only (no Python object), and the backend meta it stood in for.
class RecordTag final : public c10::BackendMeta {
 public:
  RecordTag(RecordPtr record, std::string note, c10::intrusive_ptr<c10::BackendMeta> replaced)
      : record_(std::move(record)), note_(std::move(note)), replaced_(std::move(replaced)) {}

  const RecordPtr& record() const { return record_; }
  const std::string& note() const { return note_; }
  const c10::intrusive_ptr<c10::BackendMeta>& replaced() const { return replaced_; }

  // One per poisoned donor and step, made and freed in bursts: recycled
  // (block_pool.h).
  static void* operator new(size_t bytes);
  static void operator delete(void* p);

  // torch copies a TensorImpl's metadata into its shallow copies (detach,
  // .data, saved tensors).  A copy is no donated tensor: it gets what the
  // tag replaced, as if the tensor had never been tagged.
  c10::intrusive_ptr<c10::BackendMeta> clone(
      const c10::intrusive_ptr<c10::BackendMeta>&) const override {
    return replaced_ ? replaced_->clone(replaced_) : c10::intrusive_ptr<c10::BackendMeta>();
  }

 private:
  RecordPtr record_;
  std::string note_;
  c10::intrusive_ptr<c10::BackendMeta> replaced_;
};

void* RecordTag::operator new(size_t) {  // final: always sizeof(RecordTag)
  return BlockPool<sizeof(RecordTag)>::Global().Get();
}
void RecordTag::operator delete(void* p) { BlockPool<sizeof(RecordTag)>::Global().Put(p); }

RecordTag* TagOf(c10::TensorImpl* impl) {
  return dynamic_cast<RecordTag*>(impl->get_backend_meta());
}

}  // namespace

bool TagRecord(uintptr_t address, RecordPtr record, std::string note) {
  auto* impl = reinterpret_cast<c10::TensorImpl*>(address);
  try {
    RecordTag* old = TagOf(impl);
    auto replaced = old ? old->replaced() : impl->get_backend_meta_intrusive_ptr();
    impl->set_backend_meta(
        c10::make_intrusive<RecordTag>(std::move(record), std::move(note), std::move(replaced)));
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

RecordPtr TaggedRecord(uintptr_t address) {
  RecordTag* tag = TagOf(reinterpret_cast<c10::TensorImpl*>(address));
  return tag ? tag->record() : RecordPtr();
}

std::string TaggedNote(uintptr_t address) {
  RecordTag* tag = TagOf(reinterpret_cast<c10::TensorImpl*>(address));
  return tag ? tag->note() : std::string();
}

void UntagRecord(uintptr_t address) {
  auto* impl = reinterpret_cast<c10::TensorImpl*>(address);
  if (RecordTag* tag = TagOf(impl)) impl->set_backend_meta(tag->replaced());
}

}  // namespace torch_xla_donate
