"""GPUs' dense bf16 peaks from NVIDIA's datasheets, the yardstick the field quotes GPU MFU
against. machine/perf.py reads them on a GPU only.

Usage:
    from machine.datasheets import datasheet_peak_flops
    datasheet_peak_flops("NVIDIA H100 80GB HBM3")   # 989e12; None for a GPU not listed
"""

# In FLOP/s. They match the device name in order, so longer names come first.
GPU_BF16_PEAK_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM, e.g. "NVIDIA H100 80GB HBM3"
    ("H200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
)


def datasheet_peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named like torch.cuda.get_device_name(), if known."""
    return next((flops for key, flops in GPU_BF16_PEAK_FLOPS if key in device_name), None)
