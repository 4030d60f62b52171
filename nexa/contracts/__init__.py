"""The vocabulary: pure data, no I/O, no trio. Import from the submodules explicitly."""
