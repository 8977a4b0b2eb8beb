"""The command line that the commands share: the options of sample.py, serve.py and
evaluate.py, each declared once, and the check of an output path before the work.

Usage:
    from cli.options import DeviceOption, RunOption, check_output_file
"""
