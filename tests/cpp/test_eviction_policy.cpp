// Eviction policies on their own (no manager, no backend): LRU's order, 2Q's protection of
// re-accessed blocks against scans, Belady's farthest-next-use choice from the previous step's
// trace (and its LRU fallback before a trace exists), and parse_policy. The expected victims are
// computed by the test from its own record of the accesses, never copied from the code.
#include "test_util.h"

#include <algorithm>
#include <limits>
#include <map>
#include <set>

namespace reviva::test {
namespace {

constexpr std::size_t kBlockBytes = 4096;

// A policy plus the test's own view of what it was told: which blocks are registered, which are
// resident (accessed since their last eviction, the only legal candidates) and when each was last
// accessed.
class PolicyModel {
 public:
  explicit PolicyModel(PolicyKind kind) : policy_(make_policy(kind)) {}

  EvictionPolicy& policy() { return *policy_; }

  void add(BlockId id) {
    policy_->on_register(id, kBlockBytes);
    registered_.insert(id);
  }
  void remove(BlockId id) {
    policy_->on_unregister(id);
    registered_.erase(id);
    resident_.erase(id);
    last_access_.erase(id);
  }
  void access(BlockId id) {
    policy_->on_access(id);
    resident_.insert(id);
    last_access_[id] = ++clock_;
  }
  void evict(BlockId id) {
    policy_->on_evict(id);
    resident_.erase(id);
  }
  BlockId choose(const std::vector<BlockId>& candidates) {
    const BlockId victim = policy_->choose_victim(candidates);
    EXPECT_NE(std::find(candidates.begin(), candidates.end(), victim), candidates.end())
        << policy_->name() << " chose block " << victim << ", which is not a candidate";
    return victim;
  }
  // The candidate accessed longest ago (what LRU must choose).
  BlockId least_recent(const std::vector<BlockId>& candidates) const {
    return *std::min_element(candidates.begin(), candidates.end(), [&](BlockId a, BlockId b) {
      return last_access_.at(a) < last_access_.at(b);
    });
  }
  const std::set<BlockId>& resident() const { return resident_; }
  const std::set<BlockId>& registered() const { return registered_; }

 private:
  std::unique_ptr<EvictionPolicy> policy_;
  std::set<BlockId> registered_;
  std::set<BlockId> resident_;
  std::map<BlockId, std::uint64_t> last_access_;
  std::uint64_t clock_ = 0;
};

std::vector<BlockId> random_subset(const std::set<BlockId>& from, std::mt19937_64& rng) {
  std::vector<BlockId> all(from.begin(), from.end());
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(1 + rng() % all.size());
  return all;
}

// Random registrations, accesses, evictions and unregistrations; at random points the policy is
// asked for a victim among a random subset of the resident blocks. `check` sees each choice.
template <typename Check>
void random_workload(PolicyModel& model, std::uint64_t seed, int ops, bool step_ends, Check check) {
  std::mt19937_64 rng(seed);
  BlockId next_id = 1;
  for (int i = 0; i < 8; ++i) model.add(next_id++);
  for (int op = 0; op < ops; ++op) {
    const int r = static_cast<int>(rng() % 100);
    const std::vector<BlockId> registered(model.registered().begin(), model.registered().end());
    if (r < 5 || registered.empty()) {
      model.add(next_id++);
    } else if (r < 8 && registered.size() > 2) {
      model.remove(registered[rng() % registered.size()]);
    } else if (r < 60) {
      model.access(registered[rng() % registered.size()]);
    } else if (r < 62 && step_ends) {
      model.policy().on_step_end();
    } else if (!model.resident().empty()) {
      const auto candidates = random_subset(model.resident(), rng);
      const BlockId victim = model.choose(candidates);
      check(candidates, victim);
      if (rng() % 2) model.evict(victim);
    }
  }
}

TEST(LruPolicy, PicksTheLeastRecentlyAccessedCandidate) {
  PolicyModel m(PolicyKind::Lru);
  for (BlockId id = 1; id <= 5; ++id) m.add(id);
  for (BlockId id : {1, 2, 3, 4, 5, 2, 1}) m.access(id);
  EXPECT_EQ(m.choose({1, 2, 3, 4, 5}), 3u);
  EXPECT_EQ(m.choose({5, 4, 2, 1}), 4u);  // among the candidates only
  m.evict(3);
  m.access(4);  // 5 is now the oldest
  EXPECT_EQ(m.choose({1, 2, 4, 5}), 5u);
  m.access(3);  // re-admitted after eviction: the most recent
  EXPECT_EQ(m.choose({1, 3}), 1u);
}

TEST(LruPolicy, RandomWorkloadAlwaysPicksTheLeastRecentCandidate) {
  for (std::uint64_t seed : {1u, 2u, 3u}) {
    SCOPED_TRACE("seed=" + std::to_string(seed));
    PolicyModel m(PolicyKind::Lru);
    random_workload(m, seed, scaled(4000), /*step_ends=*/true,
                    [&](const std::vector<BlockId>& candidates, BlockId victim) {
                      ASSERT_EQ(victim, m.least_recent(candidates));
                    });
  }
}

TEST(TwoQPolicy, EvictsAOnceSeenBlockBeforeAReaccessedOne) {
  PolicyModel m(PolicyKind::TwoQ);
  const BlockId hot = 1, once_a = 2, once_b = 3, once_c = 4;
  for (BlockId id = 1; id <= 4; ++id) m.add(id);
  m.access(hot);
  m.access(hot);  // seen again: the protected LRU (Am)
  m.access(once_a);
  m.access(once_b);
  m.access(once_c);
  // LRU would take `hot` (accessed longest ago); 2Q takes the oldest once-seen block (FIFO).
  ASSERT_EQ(m.least_recent({hot, once_a, once_b, once_c}), hot);
  EXPECT_EQ(m.choose({hot, once_a, once_b, once_c}), once_a);
  m.evict(once_a);
  EXPECT_EQ(m.choose({hot, once_b, once_c}), once_b);
}

TEST(TwoQPolicy, BlockReadmittedFromTheGhostQueueIsProtected) {
  PolicyModel m(PolicyKind::TwoQ);
  for (BlockId id = 1; id <= 5; ++id) m.add(id);
  const BlockId ghost = 1;
  m.access(ghost);
  m.evict(ghost);   // remembered in A1out
  m.access(ghost);  // re-admitted while remembered: Am
  for (BlockId id : {2, 3, 4, 5}) m.access(id);
  ASSERT_EQ(m.least_recent({1, 2, 3, 4, 5}), ghost);
  EXPECT_EQ(m.choose({1, 2, 3, 4, 5}), 2u);
}

TEST(TwoQPolicy, AScanOfOneTimeBlocksDoesNotEvictTheHotSet) {
  // A hot set seen twice, then a long scan of one-time blocks through a cache with room for the
  // hot set and a few more: every victim must be a scan block. (LRU would flush the hot set.)
  for (PolicyKind kind : {PolicyKind::TwoQ, PolicyKind::Lru}) {
    SCOPED_TRACE(to_string(kind));
    PolicyModel m(kind);
    const std::vector<BlockId> hot = {1, 2, 3, 4};
    for (BlockId id : hot) m.add(id);
    for (int round = 0; round < 2; ++round)
      for (BlockId id : hot) m.access(id);
    const std::size_t capacity = hot.size() + 8;
    int hot_evictions = 0;
    for (BlockId scan = 100; scan < 100 + 200; ++scan) {
      m.add(scan);
      if (m.resident().size() + 1 > capacity) {
        const std::vector<BlockId> candidates(m.resident().begin(), m.resident().end());
        const BlockId victim = m.choose(candidates);
        if (std::find(hot.begin(), hot.end(), victim) != hot.end()) ++hot_evictions;
        m.evict(victim);
      }
      m.access(scan);
      // The hot set keeps being used now and then (as a model's weights would be), but rarely
      // enough that LRU has evicted it in between.
      if ((scan - 100) % 50 == 49)
        for (BlockId id : hot) m.access(id);
    }
    if (kind == PolicyKind::TwoQ) {
      EXPECT_EQ(hot_evictions, 0) << "the scan evicted hot blocks";
    } else {
      EXPECT_GT(hot_evictions, 0) << "the scenario does not distinguish 2Q from LRU";
    }
  }
}

TEST(TwoQPolicy, RandomWorkloadChoosesOnlyCandidates) {
  for (std::uint64_t seed : {4u, 5u, 6u}) {
    SCOPED_TRACE("seed=" + std::to_string(seed));
    PolicyModel m(PolicyKind::TwoQ);
    random_workload(m, seed, scaled(4000), /*step_ends=*/true,
                    [](const std::vector<BlockId>&, BlockId) {});
  }
}

TEST(BeladyPolicy, WithoutATraceBehavesLikeLru) {
  for (std::uint64_t seed : {7u, 8u, 9u}) {
    SCOPED_TRACE("seed=" + std::to_string(seed));
    PolicyModel m(PolicyKind::Belady);
    random_workload(m, seed, scaled(4000), /*step_ends=*/false,
                    [&](const std::vector<BlockId>& candidates, BlockId victim) {
                      ASSERT_EQ(victim, m.least_recent(candidates));
                    });
  }
}

TEST(BeladyPolicy, PicksTheCandidateUsedFarthestAheadInTheRecordedTrace) {
  PolicyModel m(PolicyKind::Belady);
  const BlockId a = 1, b = 2, c = 3, d = 4;
  for (BlockId id = 1; id <= 4; ++id) m.add(id);
  const std::vector<BlockId> step = {a, b, c, d, a, b, c, d};
  for (BlockId id : step) m.access(id);
  m.policy().on_step_end();
  // Step 2 replays step 1. Before any access, d is needed last.
  EXPECT_EQ(m.choose({a, b, c, d}), d);
  m.access(a);
  // a was just used (LRU would keep it), but its next use (position 4) is the farthest.
  ASSERT_NE(m.least_recent({a, b, c, d}), a);
  EXPECT_EQ(m.choose({a, b, c, d}), a);
  m.access(b);
  m.access(c);
  EXPECT_EQ(m.choose({b, c, d}), c);  // next uses: d 3, b 5, c 6
}

TEST(BeladyPolicy, ABlockNeverUsedAgainGoesFirst) {
  PolicyModel m(PolicyKind::Belady);
  const BlockId early = 1, a = 2, b = 3, c = 4;
  for (BlockId id = 1; id <= 4; ++id) m.add(id);
  const std::vector<BlockId> step = {early, a, b, c, a, b, c};
  for (BlockId id : step) m.access(id);
  m.policy().on_step_end();
  m.access(early);
  m.access(a);
  // `early` is not used again in this step; a, b, c are.
  ASSERT_EQ(m.least_recent({early, a, b, c}), b);
  EXPECT_EQ(m.choose({early, a, b, c}), early);
  // A block registered now is in no trace at all: it goes before all the others.
  const BlockId stranger = 9;
  m.add(stranger);
  m.access(stranger);
  EXPECT_EQ(m.choose({a, b, c, stranger}), stranger);
}

TEST(BeladyPolicy, RandomTraceReplayChoosesAFarthestNextUse) {
  for (std::uint64_t seed : {10u, 11u, 12u, 13u}) {
    SCOPED_TRACE("seed=" + std::to_string(seed));
    std::mt19937_64 rng(seed);
    PolicyModel m(PolicyKind::Belady);
    const int blocks = 12;
    for (BlockId id = 1; id <= static_cast<BlockId>(blocks); ++id) m.add(id);
    std::vector<BlockId> step(scaled(300));
    for (auto& id : step) id = 1 + rng() % blocks;
    for (BlockId id : step) m.access(id);
    m.policy().on_step_end();
    for (std::size_t pos = 0; pos < step.size(); ++pos) {
      m.access(step[pos]);
      if (rng() % 3 != 0) continue;
      const auto candidates = random_subset(m.resident(), rng);
      // Next use of each candidate after `pos` in the replayed trace; never: farthest of all.
      auto next_use = [&](BlockId id) {
        for (std::size_t j = pos + 1; j < step.size(); ++j)
          if (step[j] == id) return j;
        return std::numeric_limits<std::size_t>::max();
      };
      std::size_t farthest = 0;
      for (BlockId id : candidates) farthest = std::max(farthest, next_use(id));
      const BlockId victim = m.choose(candidates);
      ASSERT_EQ(next_use(victim), farthest)
          << "at position " << pos << " Belady chose block " << victim << " used next at "
          << next_use(victim) << ", but a candidate is used next at " << farthest;
      if (rng() % 2) m.evict(victim);
    }
  }
}

TEST(PolicyKinds, ParseAcceptsTheNamesInAnyCase) {
  EXPECT_EQ(parse_policy("lru"), PolicyKind::Lru);
  EXPECT_EQ(parse_policy("LRU"), PolicyKind::Lru);
  EXPECT_EQ(parse_policy("Lru"), PolicyKind::Lru);
  EXPECT_EQ(parse_policy("2q"), PolicyKind::TwoQ);
  EXPECT_EQ(parse_policy("2Q"), PolicyKind::TwoQ);
  EXPECT_EQ(parse_policy("belady"), PolicyKind::Belady);
  EXPECT_EQ(parse_policy("BeLaDy"), PolicyKind::Belady);
  for (PolicyKind kind : {PolicyKind::Lru, PolicyKind::TwoQ, PolicyKind::Belady}) {
    EXPECT_EQ(parse_policy(to_string(kind)), kind);
    auto policy = make_policy(kind);
    ASSERT_NE(policy, nullptr);
    EXPECT_FALSE(policy->name().empty());
  }
}

TEST(PolicyKinds, ParseRejectsOtherNamesNamingThem) {
  for (const char* bad : {"fifo", "lru2", "3q", "optimal", "beladyy"}) {
    try {
      parse_policy(bad);
      ADD_FAILURE() << "parse_policy accepted '" << bad << "'";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(parse_policy(""), InvalidArgument);
}

}  // namespace
}  // namespace reviva::test
