"""The floor every part stands on, torch-free: dtype names (`dtypes`), files and JSON from outside
(`fileio`, `jsoncost`), option checks (`options`), what this process has decided and says once
(`state`, `notices`) and its allocator (`allocator`). Imports nothing of bivit but `bivit.errors`.
"""
