// Package enter owns the last step of an exec into a local sandbox whose
// root is an image: after nsenter has entered the sandbox's namespaces and
// root (as the namespace's root), the in-sandbox stasis binary becomes the
// user the command runs as and executes it. It does what setpriv and env
// do for a sandbox on the host's userland, where those tools are the
// host's; an image need not have them, or may have versions of its own.
//
// On one locked thread it empties the ambient and inheritable capability
// sets, reduces the bounding set to the capabilities kept (none for the
// agent), sets no_new_privs, clears the supplementary groups, sets gid and
// uid, changes directory and executes the command with the environment it
// was given. Capabilities and no_new_privs are per thread, and execve
// keeps only the calling thread, so doing them on that thread is enough.
package enter

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// Arg is the first argument that selects this step in the in-sandbox
// binary (before any command-line parsing).
const Arg = "__stasis-enter"

// Request is what one exec becomes.
type Request struct {
	// UID and GID to run as; -1 keeps the current ones (stasis's user).
	UID, GID int
	// KeepCaps are the capability numbers left in the bounding set (for
	// stasis's user; an agent keeps none).
	KeepCaps []int
	Cwd      string
	Argv     []string
}

// Args is the argument list (after the binary) that makes Main run r.
func (r Request) Args() []string {
	caps := make([]string, len(r.KeepCaps))
	for i, c := range r.KeepCaps {
		caps[i] = strconv.Itoa(c)
	}
	a := []string{Arg, strconv.Itoa(r.UID), strconv.Itoa(r.GID), strings.Join(caps, ","), r.Cwd, "--"}
	return append(a, r.Argv...)
}

func parse(args []string) (Request, error) {
	if len(args) < 6 || args[5] != "--" {
		return Request{}, errors.New("usage: " + Arg + " UID GID CAPS CWD -- COMMAND [ARG]")
	}
	var r Request
	var err error
	if r.UID, err = strconv.Atoi(args[1]); err != nil {
		return r, fmt.Errorf("uid %q", args[1])
	}
	if r.GID, err = strconv.Atoi(args[2]); err != nil {
		return r, fmt.Errorf("gid %q", args[2])
	}
	if args[3] != "" {
		for _, c := range strings.Split(args[3], ",") {
			n, err := strconv.Atoi(c)
			if err != nil || n < 0 || n > 63 {
				return r, fmt.Errorf("capability %q", c)
			}
			r.KeepCaps = append(r.KeepCaps, n)
		}
	}
	r.Cwd, r.Argv = args[4], args[6:]
	if len(r.Argv) == 0 {
		return r, errors.New("no command")
	}
	return r, nil
}

// Main runs the step with args (starting with Arg) and returns an exit
// code only when it fails: 127 when the command is not found, 126 when it
// cannot be run, 125 for anything else, as env does.
func Main(args []string) int {
	r, err := parse(args)
	if err != nil {
		fmt.Fprintln(os.Stderr, "stasis enter:", err)
		return 125
	}
	code, err := run(r)
	fmt.Fprintln(os.Stderr, "stasis enter:", err)
	return code
}

// ClearInheritable empties the calling thread's ambient and inheritable
// capability sets, and returns its capabilities as they are then (the
// effective and permitted sets untouched). Capabilities are per thread:
// the caller must be locked to its OS thread.
func ClearInheritable() ([2]unix.CapUserData, error) {
	if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); err != nil && !errors.Is(err, unix.EINVAL) {
		return [2]unix.CapUserData{}, fmt.Errorf("clear the ambient capabilities: %w", err)
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return data, fmt.Errorf("read capabilities: %w", err)
	}
	data[0].Inheritable, data[1].Inheritable = 0, 0
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return data, fmt.Errorf("clear the inheritable capabilities: %w", err)
	}
	return data, nil
}

func run(r Request) (int, error) {
	runtime.LockOSThread() // never unlocked: this thread execs
	if _, err := ClearInheritable(); err != nil {
		return 125, err
	}
	keep := map[int]bool{}
	for _, c := range r.KeepCaps {
		keep[c] = true
	}
	for c := 0; c <= 63; c++ {
		if keep[c] {
			continue
		}
		if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil {
			if errors.Is(err, unix.EINVAL) {
				break // past the kernel's last capability
			}
			return 125, fmt.Errorf("drop capability %d from the bounding set: %w", c, err)
		}
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return 125, fmt.Errorf("set no_new_privs: %w", err)
	}
	if r.GID >= 0 {
		if err := syscall.Setgroups(nil); err != nil {
			return 125, fmt.Errorf("clear the groups: %w", err)
		}
		if err := syscall.Setresgid(r.GID, r.GID, r.GID); err != nil {
			return 125, fmt.Errorf("set gid %d: %w", r.GID, err)
		}
	}
	if r.UID >= 0 {
		if err := syscall.Setresuid(r.UID, r.UID, r.UID); err != nil {
			return 125, fmt.Errorf("set uid %d: %w", r.UID, err)
		}
	}
	if r.Cwd != "" {
		if err := os.Chdir(r.Cwd); err != nil {
			return 125, fmt.Errorf("change directory: %w", err)
		}
	}
	path := r.Argv[0]
	if !strings.Contains(path, "/") {
		p, err := exec.LookPath(path) // on the environment's PATH
		if err != nil {
			return 127, fmt.Errorf("%s: command not found", path)
		}
		path = p
	}
	err := syscall.Exec(path, r.Argv, os.Environ())
	if errors.Is(err, syscall.ENOENT) {
		return 127, fmt.Errorf("%s: %w", path, err)
	}
	return 126, fmt.Errorf("%s: %w", path, err)
}

// HoldArg selects the holder: the process a local sandbox whose root is
// an image keeps running under its init (the host's /bin/sh and sleep are
// not there). It says "ready" on descriptor 4, closes it, and waits until
// it is killed.
const HoldArg = "__stasis-hold"

// Hold is the holder's body.
func Hold() int {
	f := os.NewFile(4, "ready")
	if _, err := f.WriteString("ready\n"); err != nil {
		fmt.Fprintln(os.Stderr, "stasis hold:", err)
		return 125
	}
	f.Close()
	for {
		_ = unix.Pause()
	}
}
