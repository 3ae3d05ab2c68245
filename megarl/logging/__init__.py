"""Metric sinks (TensorBoard by default, console, JSONL, optional wandb) behind one `MetricsLogger`."""
from megarl.logging.metrics_logger import (GENERATIONS_FILE, SINKS, MetricsLogger, format_console_line,
                                           unavailable_sinks)

__all__ = ["GENERATIONS_FILE", "SINKS", "MetricsLogger", "format_console_line", "unavailable_sinks"]
