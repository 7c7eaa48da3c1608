# Call A: the first part of the packed Triton 3.9 wheel onto the machine (carry .device/t39a)
nvidia-smi -q | grep -E "Product Name|Power Limit" | head -2
mkdir -p /tmp/t39parts && cp .device/t39a/part_aa /tmp/t39parts/ && ls -la /tmp/t39parts
