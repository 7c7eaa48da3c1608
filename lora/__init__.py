"""LoRA files for the Wan DiT: what each key is (formats.py), module names resolved to ours
(keymap.py), a module's keys made into patches with every shape checked (build.py), a file read
against a model (file.py), the arithmetic of each kind of patch (patches.py), the merge
(merge.py), unmerged layers (layers.py), bringing a model to the LoRAs its handle asks for
(apply.py) and a whole checkpoint merged into a new file (merge_file.py).
"""
