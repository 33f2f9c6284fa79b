"""Exporting a run: its adapter merged into the base weights, as a plain transformers model."""

from .merged import DTYPES, TOLERANCE, ExportError, ExportReport, export_merged

__all__ = ["DTYPES", "TOLERANCE", "ExportError", "ExportReport", "export_merged"]
