package agent

import (
	"fmt"
	"log/slog"
	"net"
	"runtime"
	"syscall"

	"golang.org/x/sys/unix"

	"stasis/sandbox"
)

// Users splits the guest's users as the local provider's sandboxes do
// (sandbox.Capabilities.Users): a command runs as the agent (UID and GID,
// no supplementary groups, HOME Home) unless its request names
// sandbox.UserControl, which runs it as the guest agent's own user (root);
// and the files the host writes (PUT /v1/file, PUT /v1/tar) are written
// with the agent's file-system ids, so they are the agent's, and a symlink
// the agent planted cannot make the host write a file of stasis's.
type Users struct {
	UID, GID int
	Home     string
}

// Check refuses ids that are not an unprivileged user of their own.
func (u *Users) Check() error {
	if u.UID <= 0 || u.GID <= 0 || u.UID > 1<<31-2 || u.GID > 1<<31-2 {
		return fmt.Errorf("agent uid %d / gid %d: both must be above 0 (the agent must not be root) and fit a uid_t", u.UID, u.GID)
	}
	return nil
}

// Config is how Serve runs.
type Config struct {
	Log *slog.Logger // nil: discard
	// Users, when set, splits the guest's users (see Users).
	Users *Users
	// HostOnly refuses every connection whose peer is the guest itself
	// (a loopback address or one of its own interfaces' addresses): only
	// the host, through QEMU's forwarded port, may drive the agent. A
	// process in the guest that tried would otherwise run commands as
	// root through it.
	HostOnly bool
}

// credential is whom a command of request h runs as (nil: the agent's own
// user).
func (s *server) credential(h execHeader) *syscall.Credential {
	if s.users == nil || h.User == string(sandbox.UserControl) {
		return nil
	}
	return &syscall.Credential{Uid: uint32(s.users.UID), Gid: uint32(s.users.GID), Groups: []uint32{}}
}

// home is the HOME a command of request h gets by default.
func (s *server) home(h execHeader) string {
	if s.credential(h) != nil && s.users.Home != "" {
		return s.users.Home
	}
	return defaultHome
}

// asAgent runs f with the agent's file-system ids when the users are
// split (see Users), else as it is. f runs on an OS thread of its own whose
// fsuid, fsgid and groups are the agent's (a change from fsuid 0 also
// drops that thread's file capabilities); the thread is never unlocked, so
// it ends with f's goroutine and no other goroutine ever runs with those
// ids. f must not start goroutines that touch files.
func (s *server) asAgent(f func() error) error {
	if s.users == nil {
		return f()
	}
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // for good: the thread dies with the goroutine
		if _, _, e := unix.RawSyscall(unix.SYS_SETGROUPS, 0, 0, 0); e != 0 {
			done <- fmt.Errorf("drop the groups for the agent's file access: %w", e)
			return
		}
		unix.RawSyscall(unix.SYS_SETFSGID, uintptr(s.users.GID), 0, 0)
		unix.RawSyscall(unix.SYS_SETFSUID, uintptr(s.users.UID), 0, 0)
		// setfs[ug]id report no error: read them back (an invalid id
		// changes nothing and returns the current one).
		gid, _, _ := unix.RawSyscall(unix.SYS_SETFSGID, ^uintptr(0), 0, 0)
		uid, _, _ := unix.RawSyscall(unix.SYS_SETFSUID, ^uintptr(0), 0, 0)
		if int(uid) != s.users.UID || int(gid) != s.users.GID {
			done <- fmt.Errorf("take the agent's file-system ids %d/%d: the thread has %d/%d", s.users.UID, s.users.GID, uid, gid)
			return
		}
		done <- f()
	}()
	return <-done
}

// hostOnly is a listener that drops connections from the guest itself.
type hostOnly struct {
	net.Listener
	log *slog.Logger
}

func (l hostOnly) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if local, why := fromGuest(c.RemoteAddr()); local {
			l.log.Warn("refused a connection from inside the guest", "peer", c.RemoteAddr().String(), "why", why)
			c.Close()
			continue
		}
		return c, nil
	}
}

// fromGuest says whether a peer address is the guest's own: loopback, or
// an address of one of its interfaces. It fails closed: a peer it cannot
// place is refused.
func fromGuest(a net.Addr) (bool, string) {
	ta, ok := a.(*net.TCPAddr)
	if !ok {
		return true, "not a TCP peer"
	}
	if ta.IP.IsLoopback() || ta.IP.IsUnspecified() {
		return true, "loopback"
	}
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return true, "cannot list the guest's addresses: " + err.Error()
	}
	for _, ia := range addrs {
		if n, ok := ia.(*net.IPNet); ok && n.IP.Equal(ta.IP) {
			return true, "an address of the guest's own"
		}
	}
	return false, ""
}
