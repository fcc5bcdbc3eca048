"""Observability: the metric catalog (one source of truth for names, types, labels and help) and the pure pieces
that keep the exported label sets bounded. Imports nothing from the capabilities; they import from here."""
