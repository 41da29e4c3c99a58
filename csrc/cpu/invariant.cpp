#include "../invariant.h"

#include <atomic>

namespace chunkgen {
namespace {
std::atomic<bool> invariant{false};  // off by default, as Config.batch_invariant
}

bool batch_invariant() { return invariant.load(std::memory_order_relaxed); }
void set_batch_invariant(bool on) { invariant.store(on, std::memory_order_relaxed); }

}  // namespace chunkgen
