"""Metric sinks (TensorBoard by default, console, JSONL, optional wandb) behind one `MetricsLogger`."""
from megarl.logging.metrics_logger import MetricsLogger, format_console_line

__all__ = ["MetricsLogger", "format_console_line"]
