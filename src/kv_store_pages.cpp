// KVStore's paged layers (see kv_store.h): the pages of a layer not resident from the start
// (Note [Paged layers]), their checks, acquire, reserve, write and release, and the order a
// paged prefill declares (Note [Paged prefill order]). The store's whole layers, residency,
// budget and cycle are kv_store.cpp's.
//
// Note [Paged layers]
// A streamed layer brought in whole needs a layer's bytes of staging room per slot: at 64k
// tokens of the 8B shape two slots (the one in use and the one being filled) hold 537 MB that
// could keep another layer resident, at 512k 4.3 GB. With options.page_tokens > 0 a layer that
// is not resident from the start is kept as pages of page_tokens tokens, each an append block of
// the manager (its own write-through host copy, its device memory grown as tokens arrive), and
// the decode cycle declared to the scheduler lists a paged layer's pages in order and then the
// page that takes the step's token (compute attends first, to the pages and the new token's own
// K/V, then writes the token: the last page read stays on the device for that write), so a step
// brings such a layer in page by page, `prefetch_layers` pages ahead, into a staging room of
// page_slots pages. (Writing first made every step fetch the last page twice: 41% more bytes on
// a tiny model's decode, CPU.) Prefill writes a paged layer's pages as its chunks arrive, holding
// the pages written so far (a layer's bytes: the slots' room, as before). Compute reads a paged
// layer by pages, merging attention across them (reviva/cache/block_attention.py). A promotion
// keeps a paged layer's pages on the device (kept blocks: never evicted, their host copies given
// back), so a promoted layer stays paged; one that finds no memory part way keeps what it kept and
// streams the rest. Layers resident from the start stay whole (one contiguous block), as without
// pages. The budget: a layer's bytes per whole resident layer and per slot, the kept pages' bytes,
// and a page's bytes per page slot.
#include <reviva/error.h>
#include <reviva/kv_store.h>

#include <algorithm>
#include <vector>

namespace reviva {

BlockId KVStore::page_at(int layer, std::size_t page, const char* what) const {
  block_at(layer, what);
  const auto& pages = pages_[static_cast<std::size_t>(layer)];
  REVIVA_CHECK_ARG(!pages.empty(), "KVStore::", what, ": layer ", layer,
                   " is not paged (resident from the start, or page_tokens 0)");
  REVIVA_CHECK_ARG(page < pages.size(), "KVStore::", what, ": page ", page, " of layer ", layer,
                   " out of range [0, ", pages.size(), ")");
  return pages[page];
}

void KVStore::check_page_acquired(int layer, std::size_t page, const char* what) const {
  page_at(layer, page, what);
  REVIVA_CHECK_ARG(page_acquired_[static_cast<std::size_t>(layer)][page] != nullptr,
                   "KVStore::", what, ": page ", page, " of layer ", layer, " is not acquired");
}

// A page's bytes: page_tokens tokens (the last page of a layer what is left of its capacity).
std::size_t KVStore::page_bytes(std::size_t page) const {
  const std::size_t first = page * options_.page_tokens;
  const std::size_t tokens = std::min(options_.page_tokens, options_.capacity_tokens - first);
  return tokens * options_.token_bytes;
}

bool KVStore::paged(int layer) const {
  block_at(layer, "paged");
  return !pages_[static_cast<std::size_t>(layer)].empty();
}

std::size_t KVStore::pages(int layer) const {
  page_at(layer, 0, "pages");
  return (length(layer) + options_.page_tokens - 1) / options_.page_tokens;
}

void* KVStore::acquire_page(int layer, std::size_t page, const Stream& compute) {
  const BlockId id = page_at(layer, page, "acquire_page");
  const auto i = static_cast<std::size_t>(layer);
  REVIVA_CHECK_ARG(page_acquired_[i][page] == nullptr, "KVStore::acquire_page: page ", page,
                   " of layer ", layer, " is already acquired");
  started_ = true;
  if (!manager_->kept(id)) {
    const BlockState state = manager_->state(id);
    if (state == BlockState::Device || state == BlockState::ToDevice) {
      ++counts_.slot_hits;
    } else {  // room beside what compute holds: the slots' and the page slots' (in bytes)
      std::size_t held = page_bytes(page) + staged_pages_bytes_;
      for (std::size_t l = 0; l < acquired_.size(); ++l)
        if (acquired_[l] != nullptr && !resident_[l]) held += layer_bytes();
      const std::size_t room = static_cast<std::size_t>(slots_) * layer_bytes() +
                               static_cast<std::size_t>(page_slots_) * page_bytes(0);
      REVIVA_CHECK_ARG(held <= room, "KVStore::acquire_page: page ", page, " of layer ", layer,
                       " needs ", page_bytes(page), " bytes of staging room, but compute holds ",
                       held - page_bytes(page), " of the ", room, " there is (", slots_, " slots, ",
                       page_slots_, " page slots): release pages, or add room");
    }
  }
  const std::vector<void*> ptrs = scheduler_->acquire_group({&id, 1}, compute, Access::ReadWrite);
  page_acquired_[i][page] = ptrs.front();
  if (!manager_->kept(id)) staged_pages_bytes_ += page_bytes(page);
  return ptrs.front();
}

void KVStore::reserve_page(int layer, std::size_t page, std::size_t tokens) {
  check_page_acquired(layer, page, "reserve_page");
  const std::size_t most = page_bytes(page) / options_.token_bytes;
  REVIVA_CHECK_ARG(tokens <= most, "KVStore::reserve_page: ", tokens, " tokens exceed page ", page,
                   "'s ", most);
  if (tokens == 0) return;
  manager_->grow(pages_[static_cast<std::size_t>(layer)][page], tokens * options_.token_bytes);
}

std::size_t KVStore::reserved_page_tokens(int layer, std::size_t page) const {
  check_page_acquired(layer, page, "reserved_page_tokens");
  return manager_->bytes(pages_[static_cast<std::size_t>(layer)][page]) / options_.token_bytes;
}

void KVStore::wrote_page(int layer, std::size_t page, std::size_t first, std::size_t count,
                         const Stream& compute) {
  check_page_acquired(layer, page, "wrote_page");
  const auto i = static_cast<std::size_t>(layer);
  const BlockId id = pages_[i][page];
  const std::size_t tb = options_.token_bytes;
  REVIVA_CHECK_ARG(page == 0 || manager_->valid_bytes(pages_[i][page - 1]) == page_bytes(page - 1),
                   "KVStore::wrote_page: page ", page, " of layer ", layer, " written before page ",
                   page - 1, " is full (pages fill in order)");
  const std::size_t length = manager_->valid_bytes(id) / tb;
  REVIVA_CHECK_ARG(first <= length, "KVStore::wrote_page: tokens from ", first,
                   " would leave a gap after the page's ", length, " tokens");
  const std::size_t reserved = manager_->bytes(id) / tb;
  REVIVA_CHECK_ARG(count <= reserved && first <= reserved - count, "KVStore::wrote_page: tokens [",
                   first, ", ", first + count, ") of page ", page, " of layer ", layer,
                   " were not reserved (", reserved,
                   " tokens are): call reserve_page() before compute writes them");
  counts_.bytes_to_host += manager_->wrote(id, first * tb, count * tb, compute);
  // The decode cycle follows the page that takes the next token (a prefill order stays).
  if (prefill_order_layer_ < 0 && write_page(layer) != cycle_write_page_[i]) declare_cycle();
}

// Note [Paged prefill order]
// A paged layer's prefill attends each chunk to the pages before it, which the page slots cannot
// all hold: every chunk reads them again from the host (at 64k of the 8B shape in 8192-token
// pages and 3584-token chunks, ~75 page reads a layer). Under the decode cycle's order a
// chunk's return to page 0 was off the order, so its fetch started on demand and compute waited;
// declared in prefill's own order, each read is brought in `prefetch_layers` accesses ahead, and
// knowing each page's next use the scheduler keeps the pages read again soon. Host backend, two
// layers of 96 tokens in 16-token pages and 24-token chunks (ChunkedPrefillInItsDeclaredOrder-
// PrefetchesEveryRead): 7 of 29-32 fetches on demand and 64-72 KB moved in the cycle's order,
// 0-1 of 20-22 and 49-52 KB in prefill's.
void KVStore::declare_prefill_order(int layer, std::size_t first, std::size_t end,
                                    std::size_t chunk) {
  check_open("declare_prefill_order");
  REVIVA_CHECK_ARG(paged(layer), "KVStore::declare_prefill_order: layer ", layer, " is not paged");
  REVIVA_CHECK_ARG(chunk > 0, "KVStore::declare_prefill_order: chunk must be > 0");
  REVIVA_CHECK_ARG(first <= end && end <= options_.capacity_tokens,
                   "KVStore::declare_prefill_order: tokens [", first, ", ", end,
                   ") outside the capacity of ", options_.capacity_tokens);
  const auto i = static_cast<std::size_t>(layer);
  const std::size_t page = options_.page_tokens;
  std::vector<std::vector<BlockId>> order;
  for (std::size_t s = first; s < end; s += chunk) {
    const std::size_t e = std::min(end, s + chunk);
    for (std::size_t j = 0; j < (s + page - 1) / page; ++j) order.push_back({pages_[i][j]});
    for (std::size_t j = s / page; j <= (e - 1) / page; ++j) order.push_back({pages_[i][j]});
  }
  if (order.empty()) return;
  prefill_order_layer_ = layer;
  scheduler_->declare_order(std::move(order));
}

void KVStore::end_prefill_order() {
  if (prefill_order_layer_ < 0) return;
  prefill_order_layer_ = -1;
  if (!closed_) declare_cycle();
}

void KVStore::release_page(int layer, std::size_t page, const Stream& compute) {
  check_page_acquired(layer, page, "release_page");
  const auto i = static_cast<std::size_t>(layer);
  page_acquired_[i][page] = nullptr;
  const BlockId id = pages_[i][page];
  if (!manager_->kept(id)) staged_pages_bytes_ -= page_bytes(page);  // (no promotion while held)
  scheduler_->release_group({&id, 1}, compute);
}

std::shared_ptr<ArenaBuffer> KVStore::page_buffer(int layer, std::size_t page) const {
  check_page_acquired(layer, page, "page_buffer");
  return allocator_->buffer_of(page_acquired_[static_cast<std::size_t>(layer)][page]);
}

}  // namespace reviva
