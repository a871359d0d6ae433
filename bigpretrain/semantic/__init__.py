"""WordNet access, the semantic tree over classes, and semantic metrics."""
