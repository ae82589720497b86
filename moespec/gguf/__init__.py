"""GGUF MoE files as input: the files llama.cpp users already have, experts moved packed.

A GGUF model (a .gguf file, a split set, a folder or a Hub repo with one) is prepared once into a
small folder under moespec's home (sidecar.py: config.json from the metadata, the tokenizer and
chat template transformers reads from the file, and the file's tensor table); the loader reads
it through moespec.runtime.host.gguf_source.GgufSource, its one seam (runtime.host.source). Dense tensors are
dequantised once at load to the compute dtype (dequant.py, on the load device); expert tensors
ffn_{gate,up,down}_exps become one store row per expert in their GGUF block format (layout.py),
read from the file tensor by tensor and dequantised after the copy, wherever the row is computed.

files.py finds the parts, reader.py parses headers (gguf's GGUFReader) and reads bytes, config.py
maps metadata to a transformers config per architecture, names.py maps tensor names with gguf's
own tables, export.py writes transformers models as llama.cpp would (round trips and tests).
"""

from moespec.artifacts import GGUF_SOURCE_FILE as SOURCE_FILE  # "the weights are this GGUF" (runtime.load.open_source)

__all__ = ["SOURCE_FILE"]
