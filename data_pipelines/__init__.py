"""Per-corpus recipes that turn a public source into raw text files for `scaletrain prepare`."""
