"""Tutorial 15: more cores than one host has: the same pipeline, its workers on a Ray cluster.

When the Python work of a source (decoding an unusual format, augmenting,
tokenising) needs more cores than the GPU host has, the source's workers can
run as Ray actors on CPU nodes. Nothing in the callback changes; the pipeline
gains ``py_backend="ray"``, and the host connects to the cluster first:

    # on the head node:           ray start --head --port=6379
    # on each CPU node:           ray start --address=HEAD_IP:6379
    # on the GPU host, in Python: ray.init(address="HEAD_IP:6379")
    pipe = jpeg_pipeline(..., py_num_workers=16, py_backend="ray",
                         py_ray_options={"num_cpus": 1})

Here the cluster is local: ``ray.cluster_utils.Cluster`` starts a head and
one more node in this machine, one CPU each, so the two actors land on two
nodes. Each sample carries the id of the node that read it, to show that
both did the work. The callback and its data travel to the actors with
cloudpickle; each batch comes back through Ray's object store and is copied
once into the pipeline's shared memory.

Run: ``python tutorials/15_ray_cluster.py [OUT_DIR] [--gpu]`` (needs
``pip install 'extsrc[ray]'``).
"""

import os
from importlib.resources import files

import numpy as np
from nvidia.dali import types

from extsrc import Order
from extsrc import fn, pipeline_def

import tutorial_io

DATA_DIR = str(files("extsrc") / "data")
BATCH_SIZE = 8
NODES = 2  # the head and one more, 1 CPU each: one actor per node
NODE_ID_BYTES = 56  # Ray's node ids: 28 bytes, written in hex


class NodeTaggingReader:
    """Reads JPEG ``info.record`` with its label, and the id of the Ray node that read it."""

    def __init__(self, data_dir: str):
        with open(os.path.join(data_dir, "labels.txt")) as f:
            self.samples = [(name, int(label)) for name, label in (line.split() for line in f)]
        # The bytes travel with the callback: the nodes need not see this folder.
        self.jpegs = [np.fromfile(os.path.join(data_dir, "images", name), dtype=np.uint8)
                      for name, _ in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __call__(self, info):
        import ray  # in the actor: where it runs

        node = ray.get_runtime_context().get_node_id().encode()
        tag = np.frombuffer(node.ljust(NODE_ID_BYTES)[:NODE_ID_BYTES], dtype=np.uint8)
        return self.jpegs[info.record], np.array([self.samples[info.record][1]], np.int32), tag


@pipeline_def(batch_size=BATCH_SIZE, num_threads=1)
def jpeg_pipeline(source, decoder_device):
    jpegs, labels, nodes = fn.external_source(source=source, num_outputs=3, batch=False, parallel=True,
                                              order=Order(len(source)),
                                              dtype=[types.UINT8, types.INT32, types.UINT8])
    return fn.decoders.image(jpegs, device=decoder_device, output_type=types.RGB), labels, nodes


def main(argv=None):
    args = tutorial_io.parse_args(__doc__, argv)
    device, device_id = tutorial_io.decoder_device(args)
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(NODES - 1):
        cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        reader = NodeTaggingReader(DATA_DIR)
        pipe = jpeg_pipeline(reader, device, device_id=device_id, py_num_workers=NODES,
                             py_backend="ray")
        pipe.build()
        images, labels, node_ids = [], [], []
        for _ in range(len(reader) // BATCH_SIZE):  # one epoch
            out_images, out_labels, out_nodes = pipe.run()
            tutorial_io.add_batch(images, labels, out_images, out_labels)
            node_ids += [bytes(np.array(out_nodes[i])).decode().strip() for i in range(len(out_nodes))]
        pipe.close()
    finally:
        ray.shutdown()
        cluster.shutdown()
    names = sorted(set(node_ids))
    for index, name in enumerate(names):
        print(f"node {index} ({name[:12]}...): {node_ids.count(name)} samples")
    tutorial_io.save(args.out, __file__, images, labels,
                     nodes=[names.index(node) for node in node_ids])


if __name__ == "__main__":
    main()
