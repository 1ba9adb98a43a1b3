"""The device: the peak table and its resolver, calibration, the choice of the MFU peak, and the
NVML sampler."""
