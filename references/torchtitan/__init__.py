"""torchtitan reference: torchtitan's Llama3 model, FSDP2 wrapping, loss, clipping and optimizer as a library."""
