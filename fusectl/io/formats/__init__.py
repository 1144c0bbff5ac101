"""The formats fusectl reads and writes, one module each (the registry that knows them:
:mod:`fusectl.io.registry`); the machinery they share is in :mod:`fusectl.io`."""
