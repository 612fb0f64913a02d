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
// the tensor, since views share one StorageImpl: its data pointer is dropped (giving the buffer
// back) and its size set to 0, and torch's check on storage access (the one fake tensors use)
// raises our message on any read or write of its data; shapes, dtypes and devices still read.
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
    const c10::Device device = impl->device();
    impl->set_data_ptr_noswap(at::DataPtr(nullptr, device));  // (its deleter gives the buffer back)
    impl->set_nbytes(0);
    impl->release_data_and_set_meta_custom_data_ptr_error_msg_(why);
  }

  std::unordered_map<long, std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>>> granted_;
};

}  // namespace reviva::python
