"""What a local worker imports, loaded once by the forkserver that starts them (`local_workers.run_local_workers`).

Importing megatron-core costs about 9 s of CPU (it pulls in torch._inductor and wandb); every worker forked from the
forkserver starts with these modules loaded instead of importing them again. Only modules that import without
side effects on devices belong here (nothing initialises CUDA or a process group on import).
"""

from megatron_scalerl.platform.cpu_compat import silence_cpu_import_warnings

silence_cpu_import_warnings()

import megatron.core  # noqa: E402,F401
import megatron.core.dist_checkpointing  # noqa: E402,F401
import megatron.core.distributed  # noqa: E402,F401
import megatron.core.models.gpt  # noqa: E402,F401
import megatron.core.optimizer  # noqa: E402,F401
import transformers  # noqa: E402,F401
