// Package supervisor owns the in-sandbox supervisor: it launches the agent
// harness, pauses it at checkpoints (stop mode: SIGSTOP to the whole tree,
// confirmed from /proc; hold mode: no signal, the relay holds model calls;
// hold+freeze: hold, and the tree frozen by the cgroup v2 freezer),
// continues or relaunches it, enforces its run budget with paused time
// credited, and kills and reaps every descendant when it ends.
//
// The pieces:
//   - Machine (machine.go): the pure state machine of pause, continue,
//     deadline, stop and exit, driven through the Process, Gate and Clock
//     interfaces so tests step it without processes or time;
//   - procLayer and RunShim (process.go, shim.go): the real process layer;
//     the shim between supervisor and harness kills the tree if the
//     supervisor is killed;
//   - freezer (cgroup.go): the harness's control group for hold+freeze,
//     which the shim starts the harness in;
//   - the harness user's jail and environment (jail.go);
//   - the control protocol (protocol.go): one JSON request and one JSON reply
//     per connection on DIR/control.sock, served by Run (server.go) and
//     spoken by Call (client.go), which `stasis ctl` wraps;
//   - Spawn (spawn.go): start a supervisor as a child process, as a host does.
package supervisor
