package supervisor

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"unsafe"

	seccomp "github.com/elastic/go-seccomp-bpf"
	"github.com/elastic/go-seccomp-bpf/arch"
	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"

	"stasis/internal/enter"
)

// HarnessUser is the uid and gid the harness runs as when it is not the
// supervisor's own user (`supervise --harness-uid N --harness-gid N`).
//
// The shim, still the supervisor's user (it keeps CAP_KILL to end the
// tree), prepares the harness's start on one locked thread: it empties its
// ambient and inheritable capability sets and, when it holds CAP_SETPCAP,
// its bounding set; sets no_new_privs; installs the harness filter (see
// HarnessFilter); then starts the harness with the supplementary groups
// cleared and the gid and uid set (Go does those three calls between fork
// and exec). The uid change from the supervisor's uid 0 to a non-zero one
// clears the permitted, effective and ambient sets, so the harness runs
// with no capability at all, and no_new_privs keeps setuid and file
// capabilities from giving it any.
type HarnessUser struct {
	UID int `json:"uid"`
	GID int `json:"gid"`
	// Home is the harness's HOME when it is a directory the uid owns
	// (the provider's home for its agent user; --harness-home): an image
	// whose /etc/passwd does not know the uid gives none otherwise.
	Home string `json:"home,omitempty"`
}

// Check refuses ids that are not a separate, unprivileged user.
func (u HarnessUser) Check() error {
	if u.UID <= 0 || u.GID <= 0 || u.UID > 1<<31-2 || u.GID > 1<<31-2 {
		return fmt.Errorf("harness uid %d / gid %d: both must be above 0 (the harness must not be root) and fit a uid_t", u.UID, u.GID)
	}
	if u.UID == os.Geteuid() {
		return fmt.Errorf("harness uid %d is the supervisor's own uid: give the harness a uid of its own, or leave out --harness-uid", u.UID)
	}
	return nil
}

// DeniedSyscalls are the system calls the harness filter makes fail with
// EPERM: every way to read or write another process's memory or registers
// (ptrace, process_vm_readv, process_vm_writev), to take one of its open
// files (pidfd_getfd), or to probe what it holds (kcmp).
var DeniedSyscalls = []string{"ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp"}

// compatArch is the other system call ABI a process of this architecture
// can enter the kernel by (int 0x80 on x86-64, AArch32 on arm64): a filter
// keyed on the native numbers alone would let those through.
func compatArch() *arch.Info {
	switch runtime.GOARCH {
	case "amd64":
		return arch.I386
	case "arm64":
		return arch.ARM
	}
	return nil
}

// HarnessFilter is the seccomp program the shim installs before it starts
// the harness (inherited by every process of the harness tree, and kept
// across exec):
//   - on the native ABI, DeniedSyscalls fail with EPERM; the x32 ABI's
//     calls (numbers with bit 30 set) fail with ENOSYS (the library's rule),
//     so its ptrace is no way around;
//   - on the compat ABI (i386 through int 0x80), the same calls by their
//     compat numbers fail with EPERM;
//   - everything else is allowed. The ABI is what the kernel records at
//     entry (seccomp_data.arch), not the process's personality(2), so
//     changing personality opens nothing.
//
// The native part is assembled by go-seccomp-bpf; the compat part is put
// in front of it here, since the library filters one ABI per program.
func HarnessFilter() ([]bpf.Instruction, error) {
	policy := seccomp.Policy{
		DefaultAction: seccomp.ActionAllow,
		Syscalls:      []seccomp.SyscallGroup{{Action: seccomp.ActionErrno, Names: DeniedSyscalls}},
	}
	native, err := policy.Assemble()
	if err != nil {
		return nil, fmt.Errorf("harness filter: %w", err)
	}
	c := compatArch()
	if c == nil {
		return native, nil
	}
	var nrs []uint32
	for _, name := range DeniedSyscalls {
		if nr, ok := c.SyscallNames[name]; ok {
			nrs = append(nrs, uint32(nr))
		}
	}
	// ld arch; if not compat, skip to the native program; ld nr; one test
	// per call, each jumping to the EPERM return; allow; EPERM.
	prog := []bpf.Instruction{
		bpf.LoadAbsolute{Off: 4, Size: 4},
		bpf.JumpIf{Cond: bpf.JumpEqual, Val: uint32(c.ID), SkipFalse: uint8(len(nrs) + 3)},
		bpf.LoadAbsolute{Off: 0, Size: 4},
	}
	for i, nr := range nrs {
		prog = append(prog, bpf.JumpIf{Cond: bpf.JumpEqual, Val: nr, SkipTrue: uint8(len(nrs) - i)})
	}
	prog = append(prog,
		bpf.RetConstant{Val: unix.SECCOMP_RET_ALLOW},
		bpf.RetConstant{Val: unix.SECCOMP_RET_ERRNO | uint32(unix.EPERM)},
	)
	return append(prog, native...), nil
}

// installFilter sets no_new_privs and installs prog on every thread of the
// process (TSYNC also gives every thread no_new_privs). The caller must be
// locked to its OS thread.
func installFilter(prog []bpf.Instruction) error {
	raw, err := bpf.Assemble(prog)
	if err != nil {
		return fmt.Errorf("assemble the harness filter: %w", err)
	}
	filter := make([]unix.SockFilter, len(raw))
	for i, r := range raw {
		filter[i] = unix.SockFilter{Code: r.Op, Jt: r.Jt, Jf: r.Jf, K: r.K}
	}
	fprog := unix.SockFprog{Len: uint16(len(filter)), Filter: &filter[0]}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("set no_new_privs: %w", err)
	}
	r, _, e := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, unix.SECCOMP_FILTER_FLAG_TSYNC, uintptr(unsafe.Pointer(&fprog)))
	runtime.KeepAlive(filter)
	if e != 0 {
		return fmt.Errorf("install the harness's seccomp filter: %w", e)
	}
	if r != 0 {
		return fmt.Errorf("install the harness's seccomp filter: thread %d could not take it", r)
	}
	return nil
}

// capSetpcap is CAP_SETPCAP, which dropping from the bounding set needs.
const capSetpcap = 8

// dropCapabilitySets empties the calling thread's ambient and inheritable
// sets and, if it holds CAP_SETPCAP, its bounding set; it keeps the
// effective and permitted sets (the shim's CAP_KILL). It returns the
// bounding set left (0 when emptied). The caller must be locked to its OS
// thread: capabilities are per thread, and the harness is forked from it.
func dropCapabilitySets() (uint64, error) {
	data, err := enter.ClearInheritable()
	if err != nil {
		return 0, err
	}
	last, err := lastCap()
	if err != nil {
		return 0, err
	}
	if data[0].Effective&(1<<capSetpcap) != 0 {
		for c := 0; c <= last; c++ {
			if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil {
				return 0, fmt.Errorf("drop capability %d from the bounding set: %w", c, err)
			}
		}
	}
	var left uint64
	for c := 0; c <= last; c++ {
		if r, err := unix.PrctlRetInt(unix.PR_CAPBSET_READ, uintptr(c), 0, 0, 0); err == nil && r == 1 {
			left |= 1 << c
		}
	}
	return left, nil
}

// lastCap is the highest capability number the kernel knows.
func lastCap() (int, error) {
	b, err := os.ReadFile("/proc/sys/kernel/cap_last_cap")
	if err != nil {
		return 0, fmt.Errorf("read the kernel's last capability: %w", err)
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || n < 0 || n > 63 {
		return 0, fmt.Errorf("/proc/sys/kernel/cap_last_cap says %q", b)
	}
	return n, nil
}

// SetNotDumpable makes this process non-dumpable: no core dump, and no
// process without CAP_SYS_PTRACE may ptrace it or open its /proc/PID/mem,
// environ or fd (which then belong to root). /proc/PID/stat, the identity,
// stays readable by all. exec resets it, so the shim sets it again.
func SetNotDumpable() error {
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		return fmt.Errorf("make the supervisor non-dumpable: %w", err)
	}
	return nil
}

// harnessEnv is the harness's environment: env without the supervisor's
// own identity. HOME is u.Home, or the one in env, when it is a directory
// the harness's uid owns (the provider made it the agent's); otherwise it
// is the home directory /etc/passwd gives the uid, when that exists and belongs to it, and is
// left out when neither does (the supervisor's home is the control
// user's). USER and LOGNAME are the passwd name, or left out.
func harnessEnv(env []string, u HarnessUser) []string {
	name, home := passwdEntry("/etc/passwd", u.UID)
	keep := ""
	if u.Home != "" && ownedDir(u.Home, u.UID) {
		keep = u.Home
	}
	for _, kv := range env {
		if h, ok := strings.CutPrefix(kv, "HOME="); ok && keep == "" && ownedDir(h, u.UID) {
			keep = h
		}
	}
	if keep == "" && home != "" && ownedDir(home, u.UID) {
		keep = home
	}
	out := make([]string, 0, len(env)+3)
	for _, kv := range env {
		k, _, _ := strings.Cut(kv, "=")
		if k != "HOME" && k != "USER" && k != "LOGNAME" {
			out = append(out, kv)
		}
	}
	if keep != "" {
		out = append(out, "HOME="+keep)
	}
	if name != "" {
		out = append(out, "USER="+name, "LOGNAME="+name)
	}
	return out
}

// ownedDir says whether dir is a directory that uid owns.
func ownedDir(dir string, uid int) bool {
	fi, err := os.Stat(dir)
	if err != nil || !fi.IsDir() {
		return false
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	return ok && int(st.Uid) == uid
}

// passwdEntry is the name and home directory of uid in a passwd(5) file
// ("" when it has none).
func passwdEntry(file string, uid int) (name, home string) {
	b, err := os.ReadFile(file)
	if err != nil {
		return "", ""
	}
	want := strconv.Itoa(uid)
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Split(line, ":")
		if len(f) >= 7 && f[2] == want && f[0] != "" {
			return f[0], f[5]
		}
	}
	return "", ""
}

// Access is what the harness must not be able to do to a file for it to be
// closed to the harness.
type Access int

const (
	// Read: a secret the harness must not read (the relay's token).
	Read Access = iota
	// Connect: a unix socket the harness must not connect to (which takes
	// write permission on it): the control socket, the gateway's.
	Connect
)

// CheckClosedTo refuses a file that the harness user could read (access
// Read) or connect to (Connect), or that it could put one of its own in
// the place of: a directory on the way, or a symlink met there, that it
// can change. what names the file in the message ("--relay-token-file").
func CheckClosedTo(path string, u HarnessUser, access Access, what string) error {
	w, err := walkUnreplaceable(path, u, what)
	if err != nil {
		return err
	}
	st := w.final
	open, verb := false, "read"
	switch access {
	case Read:
		open = w.reach && readable(st, u)
	case Connect:
		open, verb = w.reach && writable(st, u), "connect to"
	}
	if open {
		return fmt.Errorf("%s %s: the harness's uid %d can %s it (owner %d, group %d, mode %04o, and every directory on the way open to it): it must belong to the supervisor's user and be closed to others (chown %d:%d %s; chmod 0600 %s)",
			what, path, u.UID, verb, st.Uid, st.Gid, st.Mode&0o7777, os.Geteuid(), os.Getegid(), path, path)
	}
	return nil
}

// CheckDirClosedTo refuses a directory that the harness user could write,
// or that it could put one of its own in the place of (see CheckClosedTo).
// The session directory holds the control socket, the acknowledgements and
// the receipt: a harness that could write it could put its own socket in
// the supervisor's place, or its own acknowledgements.
func CheckDirClosedTo(dir string, u HarnessUser, what string) error {
	w, err := walkUnreplaceable(dir, u, what)
	if err != nil {
		return err
	}
	st := w.final
	if st.Mode&syscall.S_IFMT != syscall.S_IFDIR {
		return fmt.Errorf("%s %s is not a directory", what, dir)
	}
	if writable(st, u) {
		return fmt.Errorf("%s %s can be written by the harness's uid %d (owner %d, group %d, mode %04o): it must belong to the supervisor's user and not be writable by others (chown %d:%d %s; chmod go-w %s)",
			what, dir, u.UID, st.Uid, st.Gid, st.Mode&0o7777, os.Geteuid(), os.Getegid(), dir, dir)
	}
	return nil
}

// walkUnreplaceable walks to path (walk) and refuses it when the harness
// user could replace a name on the way; what names the file in errors.
func walkUnreplaceable(path string, u HarnessUser, what string) (walked, error) {
	w, err := walk(path, u)
	if err != nil {
		return w, fmt.Errorf("%s %s: %w", what, path, err)
	}
	if w.replaceable != "" {
		return w, fmt.Errorf("%s %s: %s", what, path, w.replaceable)
	}
	return w, nil
}

// walked is what walk found on the way to a file.
type walked struct {
	final       *syscall.Stat_t // the file itself (symlinks followed)
	reach       bool            // every directory searched is searchable by the harness
	replaceable string          // why the harness could replace a name on the way ("" if it cannot)
}

// maxLinks bounds the symlinks walk follows (the kernel's is 40).
const maxLinks = 40

// walk resolves path one name at a time from /, as the kernel does,
// following symlinks, and looks at each directory it searches and each
// entry it passes: the harness can replace an entry when it can write the
// directory holding it, unless that directory is sticky and the entry is
// not the harness's own; it can reach the file when it can search every
// directory searched on the way.
func walk(path string, u HarnessUser) (walked, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return walked{}, err
	}
	w := walked{reach: true}
	cur := "/"
	curSt, err := lstat(cur)
	if err != nil {
		return walked{}, err
	}
	names := strings.Split(abs, "/")
	links := 0
	for len(names) > 0 {
		name := names[0]
		names = names[1:]
		switch name {
		case "", ".":
			continue
		case "..":
			// cur has no symlink in it (every one met was resolved), so
			// its lexical parent is its real one.
			cur = filepath.Dir(cur)
			if curSt, err = lstat(cur); err != nil {
				return walked{}, err
			}
			continue
		}
		if curSt.Mode&syscall.S_IFMT != syscall.S_IFDIR {
			return walked{}, fmt.Errorf("%s is not a directory", cur)
		}
		if !searchable(curSt, u) {
			w.reach = false
		}
		next := filepath.Join(cur, name)
		st, err := lstat(next)
		if err != nil {
			return walked{}, err
		}
		if w.replaceable == "" && writable(curSt, u) && (curSt.Mode&syscall.S_ISVTX == 0 || int(st.Uid) == u.UID || int(curSt.Uid) == u.UID) {
			w.replaceable = fmt.Sprintf("the harness's uid %d can replace %s: it can write its directory %s (owner %d, group %d, mode %04o)",
				u.UID, next, cur, curSt.Uid, curSt.Gid, curSt.Mode&0o7777)
			if curSt.Mode&syscall.S_ISVTX != 0 {
				w.replaceable += ", which is sticky, but the harness owns it or the name in it"
			}
			w.replaceable += ": make every directory on the way the supervisor's and not writable by others, or sticky and the names in it not the harness's"
		}
		if st.Mode&syscall.S_IFMT == syscall.S_IFLNK {
			if links++; links > maxLinks {
				return walked{}, fmt.Errorf("more than %d symlinks on the way", maxLinks)
			}
			target, err := os.Readlink(next)
			if err != nil {
				return walked{}, err
			}
			if strings.HasPrefix(target, "/") {
				cur = "/"
				if curSt, err = lstat(cur); err != nil {
					return walked{}, err
				}
			}
			names = append(strings.Split(target, "/"), names...)
			continue
		}
		cur, curSt = next, st
	}
	w.final = curSt
	return w, nil
}

func lstat(path string) (*syscall.Stat_t, error) {
	var st syscall.Stat_t
	if err := syscall.Lstat(path, &st); err != nil {
		return nil, &fs.PathError{Op: "lstat", Path: path, Err: err}
	}
	return &st, nil
}

// The harness user's permissions on a file by its mode bits (it has no
// supplementary groups and no capabilities). It owns a file it could chmod,
// so an owned file counts as open to it whatever its mode.
func readable(st *syscall.Stat_t, u HarnessUser) bool   { return allows(st, u, 0o4) }
func writable(st *syscall.Stat_t, u HarnessUser) bool   { return allows(st, u, 0o2) }
func searchable(st *syscall.Stat_t, u HarnessUser) bool { return allows(st, u, 0o1) }

func allows(st *syscall.Stat_t, u HarnessUser, bit uint32) bool {
	switch {
	case int(st.Uid) == u.UID:
		return true
	case int(st.Gid) == u.GID:
		return st.Mode&(bit<<3) != 0
	}
	return st.Mode&bit != 0
}
