"""From bytes to pixels and grids: what an input is (`kinds`), its name (`names`), reading an image
(`decode`) or a video container (`container`) within limits, image preprocessing and the packed
batch (`pixels`), video sampling and chunks (`video`), patch grids and token counts (`grids`).
"""
