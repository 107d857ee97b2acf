"""Model code written the way people write it, for ``tests/test_compile_gallery.py``."""
