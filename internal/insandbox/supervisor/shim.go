package supervisor

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// RunShim is the body of the shim process that sits between the supervisor
// and the harness (supervisor → shim → harness). It exists so that a
// supervisor killed by SIGKILL leaves nothing behind:
//
//   - fd 3 is the lifeline, the read end of a pipe whose only writer is the
//     supervisor; when it reads EOF the supervisor is gone, and the shim kills
//     every process below it and exits;
//   - the shim is a child subreaper, so orphans of the harness tree come to it
//     rather than to init, and stay findable;
//   - fd 4 is the status pipe: "pid N" once the harness runs (or "error MSG"),
//     then "exit N" or "signal N" when it ends;
//   - with ShimHarnessEnv set to "UID:GID" it starts the harness as that
//     user, jailed (see HarnessUser); the variable is not passed on.
//
// The shim is non-dumpable, as the supervisor is (exec made it dumpable
// again).
//
// After reporting the harness's end the shim stays until the supervisor kills
// the tree (or the lifeline breaks), keeping any leftovers under its wing.
func RunShim(argv []string) int {
	life := os.NewFile(3, "lifeline")
	status := os.NewFile(4, "status")
	if life == nil || status == nil {
		fmt.Fprintln(os.Stderr, "stasis: the shim is started by `stasis supervise`, not by hand")
		return 2
	}
	// Name it for ps and /proc (launched as /proc/self/exe it would be "exe").
	_ = unix.Prctl(unix.PR_SET_NAME, uintptr(unsafe.Pointer(&[]byte("stasis-shim\x00")[0])), 0, 0, 0)
	syscall.CloseOnExec(3)
	syscall.CloseOnExec(4)
	say := func(format string, args ...any) { fmt.Fprintf(status, format+"\n", args...) }
	if err := SetNotDumpable(); err != nil {
		say("error %v", err)
		return 1
	}
	if err := SetSubreaper(); err != nil {
		say("error %v", err)
		return 1
	}
	// Catch (rather than ignore) the job-control and termination signals: a
	// caught signal is reset to default in the harness at exec, an ignored one
	// would be inherited.
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGQUIT, syscall.SIGCHLD)
	if len(argv) == 0 {
		say("error no harness command")
		return 2
	}
	cmd, code := harnessCmd(argv, say)
	if cmd == nil {
		return code
	}
	if err := cmd.Start(); err != nil {
		say("error start harness %q: %v", argv[0], err)
		return 127
	}
	harness := cmd.Process.Pid
	_ = cmd.Process.Release() // reaped below with wait4
	say("pid %d", harness)
	return shimWait(life, sigs, harness, say)
}

// harnessCmd is the command that starts the harness: in its own session,
// in the harness's control group and jailed as the harness user when the
// supervisor says so. When it cannot be made, the error is said and cmd is
// nil, with the shim's exit code.
func harnessCmd(argv []string, say func(format string, args ...any)) (cmd *exec.Cmd, code int) {
	cmd = exec.Command(argv[0], argv[1:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	// The harness leads its own session and process group.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	env, hu, err := shimHarnessUser(os.Environ())
	if err != nil {
		say("error %v", err)
		return nil, 2
	}
	env, cgroup := takeEnv(env, ShimCgroupEnv)
	cmd.Env = env
	if cgroup != "" {
		// Born inside the harness's control group (clone3
		// CLONE_INTO_CGROUP), so that a freeze reaches all of it.
		fd, err := unix.Open(cgroup, unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			say("error open the harness's control group %s: %v", cgroup, err)
			return nil, 1
		}
		cmd.SysProcAttr.UseCgroupFD, cmd.SysProcAttr.CgroupFD = true, fd
	}
	if hu != nil {
		// Capabilities are per thread, and the harness is forked from
		// this one: it stays locked for the shim's life.
		runtime.LockOSThread()
		if err := jail(cmd, *hu); err != nil {
			say("error %v", err)
			return nil, 1
		}
	}
	return cmd, 0
}

// shimWait reaps what ends below the shim, saying how the harness ended,
// until the lifeline breaks; then it kills everything below and returns
// the shim's exit code.
func shimWait(life *os.File, sigs <-chan os.Signal, harness int, say func(format string, args ...any)) int {
	lost := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, life)
		close(lost)
	}()
	reported := false
	for {
		select {
		case <-lost:
			_, _ = killBelow(os.Getpid(), 30*time.Second)
			return 1
		case s := <-sigs:
			if s != syscall.SIGCHLD {
				continue // the supervisor decides what ends the harness
			}
			reapAll(func(pid int, ws unix.WaitStatus) {
				if pid == harness && !reported {
					reported = true
					if ws.Signaled() {
						say("signal %d", int(ws.Signal()))
					} else {
						say("exit %d", ws.ExitStatus())
					}
				}
			})
		}
	}
}

// ShimHarnessEnv carries the harness user ("UID:GID", or "UID:GID:HOME")
// from the supervisor to its shim.
const ShimHarnessEnv = "STASIS_SHIM_HARNESS_USER"

// shimHarnessUser takes ShimHarnessEnv out of env and parses it (nil when
// it is not set).
func shimHarnessUser(env []string) ([]string, *HarnessUser, error) {
	out := env[:0:0]
	var val string
	set := false
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, ShimHarnessEnv+"="); ok {
			val, set = v, true
			continue
		}
		out = append(out, kv)
	}
	if !set {
		return out, nil, nil
	}
	parts := strings.SplitN(val, ":", 3)
	var uid, gid int
	var err1, err2 error
	if len(parts) >= 2 {
		uid, err1 = strconv.Atoi(parts[0])
		gid, err2 = strconv.Atoi(parts[1])
	}
	if len(parts) < 2 || err1 != nil || err2 != nil || (len(parts) == 3 && !strings.HasPrefix(parts[2], "/")) {
		return nil, nil, fmt.Errorf("%s=%q: want UID:GID or UID:GID:HOME", ShimHarnessEnv, val)
	}
	u := HarnessUser{UID: uid, GID: gid}
	if len(parts) == 3 {
		u.Home = parts[2]
	}
	if err := u.Check(); err != nil {
		return nil, nil, err
	}
	return out, &u, nil
}

// takeEnv takes key out of env and returns its value ("" when unset).
func takeEnv(env []string, key string) ([]string, string) {
	out := env[:0:0]
	val := ""
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, key+"="); ok {
			val = v
			continue
		}
		out = append(out, kv)
	}
	return out, val
}

// jail prepares cmd to start as u with no capability, no_new_privs and the
// harness filter. The caller is locked to its OS thread and starts cmd
// from it.
func jail(cmd *exec.Cmd, u HarnessUser) error {
	if _, err := dropCapabilitySets(); err != nil {
		return err
	}
	prog, err := HarnessFilter()
	if err != nil {
		return err
	}
	if err := installFilter(prog); err != nil {
		return err
	}
	// An empty Groups (with NoSetGroups false) clears the supplementary
	// groups.
	cmd.SysProcAttr.Credential = &syscall.Credential{Uid: uint32(u.UID), Gid: uint32(u.GID), Groups: []uint32{}}
	cmd.Env = harnessEnv(cmd.Env, u)
	return nil
}
