set -e
cd /work/main
for comp in "compressor=full" "compressor=snapkv compressor.budget=256"; do
  for spec in "decoding.speculative=none" "decoding.speculative=prompt_lookup" "decoding.speculative=assistant decoding.assistant=smollm2-135m"; do
    tag=$(echo "$comp $spec" | tr ' =.' '___')
    /usr/bin/time -f "%e s" .venv/bin/python -m eval.longbench experiment=demo longbench.max_new_tokens=128 $comp $spec output_dir=/tmp/meas/runs/longbench/smollm2-135m/$tag 2>&1 | tail -3
  done
done
