"""The machine under the cells: its hardware, the GPU leases, GPU memory, the processes a
cell starts, the kill domain that holds them and the supervisor that stops them."""
