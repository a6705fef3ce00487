# Source me on the device machine from the repo root: makes `expert_stream` importable from the
# working tree (the package maps streaming/, plugin/, native/) and builds the native reader.
R=$PWD
mkdir -p /tmp/es/expert_stream
ln -sfn $R/plugin/package_root/__init__.py /tmp/es/expert_stream/__init__.py
ln -sfn $R/streaming /tmp/es/expert_stream/streaming
ln -sfn $R/plugin /tmp/es/expert_stream/plugin
ln -sfn $R/native /tmp/es/expert_stream/native
INC=$(python3 -c "import sysconfig;print(sysconfig.get_paths()['include'])")
EXT=$(python3 -c "import sysconfig;print(sysconfig.get_config_var('EXT_SUFFIX'))")
gcc -O2 -shared -fPIC -I$INC native/reader.c -o native/_reader$EXT -lpthread 2>&1 | tail -3 || echo "native build failed"
export PYTHONPATH=/tmp/es${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import expert_stream.native as n, mlx.core as mx; print('native reader', n.available, mx.default_device())"
