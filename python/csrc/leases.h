// Leases: tensors handed out over memory that is the caller's only until a call gives it back
// (KVStore.view/kv until release, WeightStore.acquire until release): at that call each one still
// alive is revoked, so that a use after it raises naming the call instead of reading whatever
// the memory holds next.
//
// Note [Revoked views]
// ~~~~~~~~~~~~~~~~~~~~
// A tensor over a streamed layer's slot stays a valid pointer after release (its deleter holds
// the arena buffer mapped), but the slot is then filled with the next layer: a tensor kept past
// release read another layer's K/V or weights without an error. Revoking reaches every view of
// the tensor, since views share one StorageImpl: its size is set to 0 and torch's check on
// storage access (the one fake tensors use) raises our message on any read or write of its
// data, through torch or through the storage; shapes, dtypes and devices still read.
// The storage keeps its DataPtr, and so its arena buffer, until the StorageImpl itself dies: a
// numpy array (`.numpy()`, `np.asarray`), a DLPack capsule (`to_dlpack`, `np.from_dlpack`,
// `torch.from_dlpack`) or a tensor made from either took the raw address before the release,
// bypasses torch's check, and holds the StorageImpl (numpy's base is the tensor, a capsule holds
// an at::Tensor). Dropping the DataPtr at revoke, as this did first, let the store reuse the
// memory under such a view (it read the next layer) and the arena unmap it once the store was
// gone (it segfaulted). With the buffer held, the store's allocator never hands it to another
// block while a view lives, and the arena gives it back only when the last view is gone (Note
// [Memory held by views] in src/arena_device_allocator.cpp, which also says how that memory is
// counted against the arena's limit): such a view reads the bytes it was lent, never another
// layer's, and never freed memory. A tensor that is dropped before release costs nothing; one
// kept past it keeps its block's memory from reuse until it is dropped.
// A weak reference per tensor handed out is kept until the next revoke of its key, so a tensor
// dropped before release costs nothing there. The GIL guards the table (every caller holds it).
#pragma once

#include <torch/extension.h>

#include <string>
#include <unordered_map>
#include <vector>

namespace reviva::python {

class Leases {
 public:
  // `t` (and every view of it) is revoked at revoke(key) if it is still alive then.
  void grant(long key, const torch::Tensor& t) {
    auto& held = granted_[key];
    if (held.size() >= 64) prune(held);  // (many views in one lease: drop the dead ones)
    held.push_back(t.storage().getWeakStorageImpl());
  }

  // The tensors granted under `key` still alive become unreadable, raising `why`.
  void revoke(long key, const std::string& why) {
    auto it = granted_.find(key);
    if (it == granted_.end()) return;
    std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> held = std::move(it->second);
    granted_.erase(it);
    for (auto& weak : held) revoke_one(weak, why);
  }

  // The keys with tensors granted since their last revoke.
  std::vector<long> keys() const {
    std::vector<long> out;
    out.reserve(granted_.size());
    for (const auto& [key, held] : granted_) out.push_back(key);
    return out;
  }

  // Every tensor granted and still alive, whatever its key.
  void revoke_all(const std::string& why) {
    auto granted = std::move(granted_);
    granted_.clear();
    for (auto& [key, held] : granted)
      for (auto& weak : held) revoke_one(weak, why);
  }

 private:
  static void prune(std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>>& held) {
    std::erase_if(held, [](const auto& w) { return w.expired(); });
  }

  static void revoke_one(c10::weak_intrusive_ptr<c10::StorageImpl>& weak, const std::string& why) {
    c10::intrusive_ptr<c10::StorageImpl> impl = weak.lock();
    if (!impl) return;
    // (the DataPtr stays: a numpy array or DLPack capsule may hold its address; the buffer goes
    // back when the StorageImpl dies)
    impl->set_nbytes(0);
    impl->release_data_and_set_meta_custom_data_ptr_error_msg_(why);
  }

  std::unordered_map<long, std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>>> granted_;
};

}  // namespace reviva::python
