// Small host helpers shared by the kernels.
#include "common.cuh"

namespace hybrid {

int num_sms() {
  // One device per process in this project; the count never changes.
  static int sms = [] {
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0)
      n = 132;  // H100 SXM; only sizes the grids
    return n;
  }();
  return sms;
}

}  // namespace hybrid
