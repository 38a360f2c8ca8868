package local

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"

	"stasis/internal/control/image"
	"stasis/internal/enter"
	"stasis/sandbox"
)

// Every sandbox runs in a user namespace of its own whose ids 0–65535 are
// the host's ids UIDBase to UIDBase+65535 (uids and gids alike): no process
// of a sandbox is ever the host's root, a host file owned by anyone outside
// that range is seen as owned by nobody, and root-owned secrets of the host
// (/etc/shadow, say) cannot be read. Inside, sandbox.ControlUID (0) is
// stasis's own user, keeping only the capabilities it needs, and
// sandbox.AgentUID (1000) the agent's, with none.
//
// The range is shared by every local sandbox: they are kept from one
// another by their namespaces (PID, mount, network, IPC), each seeing only
// its own files and processes, not by their ids. Files of the writable
// places are kept with their host ids, so snapshots and forks preserve who
// owns what.
const (
	// DefaultUIDBase is the first host id of the range (2^30: far above
	// the ids that adduser and the subordinate-id ranges of
	// /etc/subuid hand out).
	DefaultUIDBase = image.DefaultIDBase
	// IDRange is how many ids the namespace maps.
	IDRange = 65536
)

// controlCaps are the capabilities stasis's own processes in a sandbox keep
// (within the sandbox's user namespace only, so over the sandbox's own
// files and processes alone): signal the harness's processes, which belong
// to the agent (kill), start the harness as the agent (setuid, setgid),
// hand it its directory (chown, fowner), and read and clean up what it
// wrote, whatever its modes (dac_override, dac_read_search). Everything
// else, mounts, raw sockets, ptrace and module loading among them, is
// dropped from the bounding set.
const controlCaps = "-all,+kill,+setuid,+setgid,+chown,+fowner,+dac_override,+dac_read_search"

// hostID is the host id of id inside a sandbox of meta m.
func (m meta) hostID(inside int) int { return m.UIDBase + inside }

// agentOwner is who the host's writes into the writable places belong to:
// the agent, so that the harness can change its own files.
func (m meta) agentOwner() (uid, gid int, ok bool) {
	if m.UIDBase == 0 {
		return 0, 0, false // a sandbox made before user namespaces
	}
	return m.hostID(sandbox.AgentUID), m.hostID(sandbox.AgentUID), true
}

// setprivArgs is how an exec becomes the user it runs as, after nsenter has
// entered the sandbox's namespaces (as the namespace's root).
func (m meta) setprivArgs(setpriv string, u sandbox.User) []string {
	if m.UIDBase == 0 {
		return []string{setpriv, "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", "--"}
	}
	if u == sandbox.UserControl {
		return []string{setpriv, "--bounding-set=" + controlCaps, "--inh-caps=-all", "--no-new-privs", "--"}
	}
	id := strconv.Itoa(sandbox.AgentUID)
	return []string{setpriv, "--reuid=" + id, "--regid=" + id, "--clear-groups", "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", "--"}
}

// controlCapNumbers are controlCaps' numbers, for internal/enter.
var controlCapNumbers = []int{unix.CAP_KILL, unix.CAP_SETUID, unix.CAP_SETGID, unix.CAP_CHOWN, unix.CAP_FOWNER, unix.CAP_DAC_OVERRIDE, unix.CAP_DAC_READ_SEARCH}

// enterRequest is setprivArgs' counterpart in a sandbox whose root is an
// image: what the in-sandbox binary becomes before it runs argv.
func (m meta) enterRequest(u sandbox.User, cwd string, argv []string) enter.Request {
	if u == sandbox.UserControl {
		return enter.Request{UID: -1, GID: -1, KeepCaps: controlCapNumbers, Cwd: cwd, Argv: argv}
	}
	return enter.Request{UID: sandbox.AgentUID, GID: sandbox.AgentUID, Cwd: cwd, Argv: argv}
}

// userNamespace is the keeper's start of bubblewrap in the sandbox's user
// namespace, as its root.
func (m meta) userNamespace() *syscall.SysProcAttr {
	a := &syscall.SysProcAttr{}
	if m.UIDBase == 0 {
		return a
	}
	idmap := []syscall.SysProcIDMap{{ContainerID: 0, HostID: m.UIDBase, Size: IDRange}}
	a.Cloneflags = syscall.CLONE_NEWUSER
	a.UidMappings, a.GidMappings = idmap, idmap
	a.GidMappingsEnableSetgroups = true
	a.Credential = &syscall.Credential{Uid: 0, Gid: 0}
	return a
}

// ownPlaces gives the writable places of a sandbox directory to the users
// of its namespace: /work and $HOME, and everything in them whose owner is
// outside the namespace's range (a work tree copied from the host, or a
// snapshot made before user namespaces), to the agent; /tmp, sticky and
// writable by all, to stasis's own user. Owners inside the range are kept.
func ownPlaces(root string, m meta) error {
	uid, gid, ok := m.agentOwner()
	if !ok {
		return nil
	}
	in := func(id uint32) bool { return int(id) >= m.UIDBase && int(id) < m.UIDBase+IDRange }
	for _, place := range []string{"work", "home"} {
		err := filepath.WalkDir(filepath.Join(root, place), func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			fi, err := d.Info()
			if err != nil {
				return err
			}
			st, _ := fi.Sys().(*syscall.Stat_t)
			if st != nil && in(st.Uid) && in(st.Gid) {
				return nil
			}
			return os.Lchown(p, uid, gid)
		})
		if err != nil {
			return fmt.Errorf("give %s to the sandbox's agent: %w", place, err)
		}
	}
	tmp := filepath.Join(root, "tmp")
	if err := os.Lchown(tmp, m.hostID(sandbox.ControlUID), m.hostID(sandbox.ControlUID)); err != nil {
		return err
	}
	return os.Chmod(tmp, os.ModeSticky|0o777) // os.FileMode: not 0o1777, whose sticky bit Go drops
}

// mkdirAllOwned makes the directories of rel under r that are missing, each
// owned by uid:gid (when ok), and returns the first error.
func mkdirAllOwned(r *os.Root, rel string, uid, gid int, ok bool) error {
	if rel == "." || rel == "" {
		return nil
	}
	if fi, err := r.Lstat(rel); err == nil {
		if fi.IsDir() {
			return nil
		}
		return fmt.Errorf("%s is not a directory", rel)
	} else if !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if err := mkdirAllOwned(r, filepath.Dir(rel), uid, gid, ok); err != nil {
		return err
	}
	if err := r.Mkdir(rel, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return err
	}
	if ok {
		return r.Lchown(rel, uid, gid)
	}
	return nil
}
