"""The port ranges our processes listen on, one machine's plan: local listeners below the SLURM jobs' ports, and both
below Linux's ephemeral range, from which every outgoing connection of the machine takes its local port (a port the
kernel hands out for bind(0) is an ephemeral one: a server starting seconds later, vLLM importing for ~10 s, lost it
to some process's outgoing connection, "Address already in use")."""

EPHEMERAL_PORTS_START = 32768  # Linux's default ephemeral range: 32768-60999
JOB_PORTS_START = 20000  # a SLURM job's 100 ports lie from here to the ephemeral range (launch.allocation)
LISTEN_PORTS = range(10000, JOB_PORTS_START)  # what `platform.free_port` draws from
