"""What SGLang needs on a CPU that its own code does not give: stand-ins for GPU-only kernels
(:mod:`.shim`, imported at interpreter start where no GPU is found), and faster or mask-free paths
hooked in by the plugin where the CPU runs them (:mod:`.gemm`: bf16 products on float32 copies;
:mod:`.attention`: the language model's extend without padding; :mod:`.vision_attention`: vision
attention without a mask). On a GPU none of them is used."""
