"""Data prep: sources, chat formatting and loss masks, packing, split files, loaders, built-in tasks."""
