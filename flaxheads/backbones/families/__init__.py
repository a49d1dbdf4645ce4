"""One module per native family of backbones."""
