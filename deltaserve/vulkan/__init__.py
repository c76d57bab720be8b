"""The Vulkan backend (`--device vulkan`): wgpu (WebGPU over Vulkan, Metal or DX12) with WGSL
compute kernels, for GPUs without CUDA."""
