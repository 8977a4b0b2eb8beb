"""The machine under everything: devices and dtypes (device.py), honest timing, memory and
MFU (perf.py), files written whole (files.py), the one-line report of a user's error
(errors.py, typer_commands.py), C built for this CPU (cbuild.py) and three operations of a
CPU's training step written out in C (cpu_kernels.py). It imports nothing of the project.

Usage:
    from machine.device import resolve_device
    from machine.files import atomic_write
"""
