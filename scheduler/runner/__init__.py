"""Running a scheduled step: block tables and step inputs on the device, the model runner, CUDA graphs,
sampling, and the tensor-parallel executor and workers that run one step on every rank."""
