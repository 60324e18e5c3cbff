"""Every test module in this package runs against one `kvserve serve` (see conftest.py)."""
