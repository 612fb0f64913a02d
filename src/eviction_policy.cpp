// LRU, 2Q and Belady eviction policies (see eviction_policy.h).
#include <reviva/error.h>
#include <reviva/eviction_policy.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <deque>
#include <limits>
#include <list>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace reviva {

EvictionPolicy::~EvictionPolicy() = default;

const char* to_string(PolicyKind kind) noexcept {
  switch (kind) {
    case PolicyKind::Lru: return "lru";
    case PolicyKind::TwoQ: return "2q";
    case PolicyKind::Belady: return "belady";
  }
  return "?";
}

PolicyKind parse_policy(std::string_view name) {
  std::string lower(name);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (lower == "lru") return PolicyKind::Lru;
  if (lower == "2q" || lower == "twoq") return PolicyKind::TwoQ;
  if (lower == "belady") return PolicyKind::Belady;
  throw InvalidArgument("unknown eviction policy '" + std::string(name) +
                        "': use 'lru', '2q' or 'belady'");
}

namespace {

// Least recently accessed first. Ties (never accessed) go to the earliest registered.
class LruPolicy : public EvictionPolicy {
 public:
  std::string name() const override { return "lru"; }
  void on_register(BlockId id, std::size_t) override { last_access_[id] = ++clock_; }
  void on_unregister(BlockId id) override { last_access_.erase(id); }
  void on_access(BlockId id) override { last_access_[id] = ++clock_; }
  void on_evict(BlockId) override {}
  BlockId choose_victim(std::span<const BlockId> candidates) override {
    BlockId best = candidates.front();
    std::uint64_t best_time = std::numeric_limits<std::uint64_t>::max();
    for (BlockId id : candidates) {
      auto it = last_access_.find(id);
      const std::uint64_t t = it == last_access_.end() ? 0 : it->second;
      if (t < best_time) {
        best_time = t;
        best = id;
      }
    }
    return best;
  }

 protected:
  std::uint64_t clock_ = 0;
  std::unordered_map<BlockId, std::uint64_t> last_access_;
};

// 2Q (Johnson & Shasha, VLDB 1994), on the blocks the manager holds: first accesses enter A1in
// (FIFO); a block accessed again while resident, or re-admitted while remembered in the ghost
// queue A1out, is promoted to Am (LRU). Victims come from A1in first (its oldest), unless A1in
// holds no candidate, then from Am's least recently used.
class TwoQPolicy : public EvictionPolicy {
 public:
  std::string name() const override { return "2q"; }
  void on_register(BlockId id, std::size_t) override { entries_[id] = Entry{}; }
  void on_unregister(BlockId id) override {
    entries_.erase(id);
    ghost_set_.erase(id);
  }
  void on_access(BlockId id) override {
    Entry& e = entries_[id];
    ++clock_;
    if (e.queue == Queue::None) {
      if (ghost_set_.erase(id)) {
        e.queue = Queue::Am;  // came back soon after leaving A1in: hot
      } else {
        e.queue = Queue::A1in;
        e.admitted = clock_;
      }
    } else if (e.queue == Queue::A1in && e.accesses > 0) {
      e.queue = Queue::Am;  // accessed again while resident
    }
    ++e.accesses;
    e.last_access = clock_;
  }
  void on_evict(BlockId id) override {
    auto it = entries_.find(id);
    if (it == entries_.end()) return;
    if (it->second.queue == Queue::A1in) remember(id);
    it->second = Entry{};
  }
  BlockId choose_victim(std::span<const BlockId> candidates) override {
    BlockId in_victim = kInvalidBlock, am_victim = kInvalidBlock;
    std::uint64_t in_time = std::numeric_limits<std::uint64_t>::max();
    std::uint64_t am_time = std::numeric_limits<std::uint64_t>::max();
    for (BlockId id : candidates) {
      const Entry& e = entries_[id];
      if (e.queue == Queue::Am) {
        if (e.last_access < am_time) am_time = e.last_access, am_victim = id;
      } else if (e.admitted < in_time) {  // A1in, or resident but never accessed
        in_time = e.admitted;
        in_victim = id;
      }
    }
    return in_victim != kInvalidBlock ? in_victim : am_victim;
  }

 private:
  enum class Queue { None, A1in, Am };
  struct Entry {
    Queue queue = Queue::None;
    std::uint64_t admitted = 0;
    std::uint64_t last_access = 0;
    std::uint64_t accesses = 0;
  };
  void remember(BlockId id) {
    if (ghost_set_.insert(id).second) ghost_.push_back(id);
    while (ghost_.size() > kGhostCapacity) {
      ghost_set_.erase(ghost_.front());
      ghost_.pop_front();
    }
  }
  static constexpr std::size_t kGhostCapacity = 4096;
  std::uint64_t clock_ = 0;
  std::unordered_map<BlockId, Entry> entries_;
  std::deque<BlockId> ghost_;  // A1out, oldest first
  std::unordered_set<BlockId> ghost_set_;
};

// Belady's MIN on the previous step's trace: the candidate whose next access is farthest (or
// absent) is evicted. The position in the current step is the number of accesses seen so far.
class BeladyPolicy : public LruPolicy {
 public:
  std::string name() const override { return "belady"; }
  void on_unregister(BlockId id) override {
    LruPolicy::on_unregister(id);
    next_uses_.erase(id);
  }
  void on_access(BlockId id) override {
    LruPolicy::on_access(id);
    current_.push_back(id);
  }
  void on_step_end() override {
    next_uses_.clear();
    for (std::size_t i = 0; i < current_.size(); ++i) next_uses_[current_[i]].push_back(i);
    have_trace_ = !current_.empty();
    current_.clear();
  }
  BlockId choose_victim(std::span<const BlockId> candidates) override {
    if (!have_trace_) return LruPolicy::choose_victim(candidates);
    const std::size_t position = current_.size();
    BlockId best = kInvalidBlock;
    std::size_t best_next = 0;
    for (BlockId id : candidates) {
      std::size_t next = std::numeric_limits<std::size_t>::max();  // not used again this step
      if (auto it = next_uses_.find(id); it != next_uses_.end()) {
        auto pos = std::lower_bound(it->second.begin(), it->second.end(), position);
        if (pos != it->second.end()) next = *pos;
      }
      if (best == kInvalidBlock || next > best_next) {
        best = id;
        best_next = next;
      }
    }
    return best;
  }

 private:
  bool have_trace_ = false;
  std::vector<BlockId> current_;
  std::unordered_map<BlockId, std::vector<std::size_t>> next_uses_;
};

}  // namespace

std::unique_ptr<EvictionPolicy> make_policy(PolicyKind kind) {
  switch (kind) {
    case PolicyKind::Lru: return std::make_unique<LruPolicy>();
    case PolicyKind::TwoQ: return std::make_unique<TwoQPolicy>();
    case PolicyKind::Belady: return std::make_unique<BeladyPolicy>();
  }
  throw InvalidArgument("make_policy: unknown policy kind");
}

}  // namespace reviva
