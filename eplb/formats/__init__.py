"""Importers and exporters: formats convert at the edge; the core speaks Trace and Placement."""
