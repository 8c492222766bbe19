// The host-side switch of launch_pdl (common.cuh). The kernels read no environment: the Python loader
// (patcher/ops/build.py) reads PATCHER_DISABLE_PDL once and calls patcher_set_pdl after loading the library.
#include "common/common.cuh"

namespace patcher {
namespace {
bool pdl = true;
}  // namespace

bool pdl_enabled() { return pdl; }

}  // namespace patcher

extern "C" void patcher_set_pdl(bool enabled) { patcher::pdl = enabled; }
