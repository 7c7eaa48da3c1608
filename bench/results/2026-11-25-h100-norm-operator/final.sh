. bench/gpu_env.sh
python3 -m pytest --gpu -q -x tests/test_glue.py tests/test_fp8_attention.py -k "operand_key_order or bit_for_bit or one_operator" 2>&1 | tail -3
peer() { python3 bench/peer_comfy.py --comfyui .device/ComfyUI --out /tmp/peer_$1 --case dit_5b --mode fp8_fp8attn_compiled --repeats 3 2>&1 | grep "fp8_fp8attn_compiled:"; }
echo "== B (norm operator)"; peer b
cp wan/dit.py /tmp/dit_b.py; cp wan/glue.py /tmp/glue_b.py
cp .device/var/dit_a.py wan/dit.py; cp .device/var/glue_a.py wan/glue.py
echo "== A (before)"; peer a
