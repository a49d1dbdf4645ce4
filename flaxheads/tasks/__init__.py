"""Tasks: what a run optimises and measures (classification, regression, ranking)."""
