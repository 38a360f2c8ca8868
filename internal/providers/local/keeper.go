package local

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"stasis/internal/bwrap"
	"stasis/internal/enter"
	"stasis/internal/proc"
	"stasis/internal/providers/hostkeep"
	"stasis/internal/storage/atomicfile"
)

// bwrapArgs builds the bubblewrap command line for a sandbox directory.
//
// The root is a fresh tmpfs holding read-only binds of the host's userland
// (bwrap.SystemRoot: /usr, /bin, /lib*, /etc without its secrets), so that
// /work, /tmp and $HOME can be mount points whether or not the host has
// them; it is made read-only at the end. /proc is the sandbox's own, /dev a
// minimal one, and there is no network but loopback. The sandbox's gateway
// directory is bound read-only at GatewayDirInSandbox. Sandboxes made
// before the allow-list (no UIDBase in meta.json) keep their view of every
// top-level entry of the host.
//
// With an image (m.Image), the root's entries are the image's top-level
// ones, read-only, and nothing of the host's is there but the binds
// below; the holder is the in-sandbox binary (EnterBinary), since the
// image need not have a shell.
//
// In its own user namespace (UIDBase set), bubblewrap is the namespace's
// root, a host uid without any right on the state directory's private
// parents (a test's 0700 temporary directory, /root), so the sandbox's own
// places are bound from a staging directory (see stage): with stageDir
// set, the k-th such source becomes stageDir/k, and bwrapArgs returns the
// real paths in that order.
func bwrapArgs(dir string, m meta, stageDir string) (args, sources []string, err error) {
	bind := func(kind, src, dst string) {
		if stageDir != "" {
			sources = append(sources, src)
			src = filepath.Join(stageDir, strconv.Itoa(len(sources)-1))
		}
		args = append(args, "--"+kind, src, dst)
	}
	args = []string{
		"--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net", "--unshare-cgroup-try",
		"--die-with-parent", "--hostname", m.ID,
	}
	switch {
	case m.Image != "":
		// The image's top-level entries, read-only (links recreated);
		// nothing of the host's.
		ents, err := os.ReadDir(m.ImageRoot)
		if err != nil {
			return nil, nil, fmt.Errorf("the sandbox's image %s: %w", m.Image, err)
		}
		for _, e := range ents {
			n := e.Name()
			switch "/" + n {
			case "/proc", "/dev", "/sys", "/tmp", "/work", "/stasis":
				continue // the sandbox's own
			}
			if e.Type()&os.ModeSymlink != 0 {
				t, err := os.Readlink(filepath.Join(m.ImageRoot, n))
				if err != nil {
					return nil, nil, err
				}
				args = append(args, "--symlink", t, "/"+n)
				continue
			}
			bind("ro-bind", filepath.Join(m.ImageRoot, n), "/"+n)
		}
	case m.UIDBase != 0:
		args = append(args, bwrap.SystemRoot(m.System...)...)
	default:
		hostRoot, err := bwrap.HostRoot("/work", "/tmp", m.Home)
		if err != nil {
			return nil, nil, err
		}
		args = append(args, hostRoot...)
	}
	args = append(args, "--proc", "/proc", "--dev", "/dev")
	if m.Limits.ShmBytes > 0 {
		// A /dev/shm of its own, of a bounded size (the host's is half
		// its RAM).
		args = append(args, "--perms", "1777", "--size", strconv.FormatInt(m.Limits.ShmBytes, 10), "--tmpfs", "/dev/shm")
	}
	for _, h := range m.Hide {
		if m.Image != "" {
			break // no host path is in the sandbox to hide
		}
		if h == "" || under(h, "/tmp") || under(h, m.Home) || under(h, "/work") {
			continue // already hidden by a writable place bound over it
		}
		if _, err := os.Stat(h); err == nil && visible(h, m) {
			args = append(args, "--tmpfs", h)
		}
	}
	root := filepath.Join(dir, rootDir)
	bind("bind", filepath.Join(root, "work"), "/work")
	bind("bind", filepath.Join(root, "home"), m.Home)
	bind("bind", filepath.Join(root, "tmp"), "/tmp")
	for _, b := range m.Binds {
		bind("bind", b, b)
	}
	dsts := make([]string, 0, len(m.ROBinds))
	src := map[string]string{}
	for h, d := range m.ROBinds {
		if !filepath.IsAbs(d) || !filepath.IsAbs(h) || under(d, "/work") || under(d, "/tmp") || under(d, m.Home) || filepath.Clean(d) == "/" {
			return nil, nil, fmt.Errorf("read-only bind %s → %s: both paths must be absolute, and the sandbox path outside /, /work, /tmp and %s", h, d, m.Home)
		}
		dsts = append(dsts, d)
		src[d] = h
	}
	if m.GatewayDir != "" {
		dsts = append(dsts, GatewayDirInSandbox)
		src[GatewayDirInSandbox] = m.GatewayDir
	}
	if m.Image != "" {
		dsts = append(dsts, EnterBinary)
		src[EnterBinary] = m.EnterBin
	}
	sort.Strings(dsts) // parents before children
	// The directories on the way to each, made 0755 (bubblewrap would
	// make them 0700 in a user namespace, closed to the agent).
	made := map[string]bool{}
	for _, d := range dsts {
		var parents []string
		for p := filepath.Dir(d); p != "/" && p != "." && !made[p]; p = filepath.Dir(p) {
			made[p] = true
			parents = append([]string{p}, parents...)
		}
		for _, p := range parents {
			if m.UIDBase != 0 && !visible(p, m) {
				args = append(args, "--perms", "0755", "--dir", p)
			}
		}
	}
	for _, d := range dsts {
		bind("ro-bind", src[d], d)
	}
	// The holder says "ready" on fd 4 once it runs, that is once bubblewrap
	// has built the whole root (the info on fd 3 comes earlier than that).
	args = append(args, "--remount-ro", "/", "--chdir", "/work", "--info-fd", "3", "--")
	if m.Image != "" {
		args = append(args, EnterBinary, enter.HoldArg)
	} else {
		args = append(args, "/bin/sh", "-c", `echo ready >&4; exec 4>&-; exec sleep infinity`)
	}
	return args, sources, nil
}

// stageCandidates are the directories the keeper may mount its staging
// tmpfs on, in its own mount namespace (the host's is not touched): the
// first that exists and holds nothing the sandbox or the keeper needs.
var stageCandidates = []string{"/run", "/mnt", "/media", "/srv", "/var/tmp", "/tmp"}

// chooseStage picks the staging mount point for a sandbox at dir.
func chooseStage(dir string, m meta) (string, error) {
	needed := append(append([]string{dir}, bwrap.System...), m.System...)
	for _, c := range stageCandidates {
		if fi, err := os.Lstat(c); err != nil || !fi.IsDir() {
			continue
		}
		clash := false
		for _, n := range needed {
			if under(n, c) || under(c, n) {
				clash = true
				break
			}
		}
		if !clash {
			return c, nil
		}
	}
	return "", fmt.Errorf("no directory to stage the sandbox's binds on: none of %v exists apart from the state directory %s and the system's directories", stageCandidates, dir)
}

// stage makes each source reachable by the sandbox's namespace root at
// stageDir/k. The keeper runs in a mount namespace of its own (the
// provider starts it so); it opens every source first, as host root,
// then mounts a small tmpfs (mode 0711) on stageDir and binds each source
// there from its descriptor, so the private parents on the host side need
// no search right for the namespace.
func stage(stageDir string, sources []string) error {
	files := make([]*os.File, 0, len(sources))
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	for _, p := range sources {
		fd, err := unix.Open(p, unix.O_PATH|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open %s to bind it into the sandbox: %w", p, err)
		}
		files = append(files, os.NewFile(uintptr(fd), p))
	}
	if err := unix.Mount("stasis-stage", stageDir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "mode=0711,size=64k,nr_inodes=4096"); err != nil {
		return fmt.Errorf("mount the staging tmpfs on %s: %w", stageDir, err)
	}
	for k, f := range files {
		var st unix.Stat_t
		if err := unix.Fstat(int(f.Fd()), &st); err != nil {
			return fmt.Errorf("stat %s: %w", f.Name(), err)
		}
		target := filepath.Join(stageDir, strconv.Itoa(k))
		if st.Mode&unix.S_IFMT == unix.S_IFDIR {
			if err := os.Mkdir(target, 0o711); err != nil {
				return err
			}
		} else if err := os.WriteFile(target, nil, 0o600); err != nil {
			return err
		}
		if err := unix.Mount(fmt.Sprintf("/proc/self/fd/%d", f.Fd()), target, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("bind %s on %s: %w", f.Name(), target, err)
		}
	}
	return nil
}

// visible says whether a path shows in the sandbox's root: always for the
// old view of every top-level entry of the host; with the allow-list, only
// under one of its entries; with an image, when the image has it.
func visible(h string, m meta) bool {
	if m.Image != "" {
		_, err := os.Lstat(filepath.Join(m.ImageRoot, h))
		return err == nil
	}
	if m.UIDBase == 0 {
		return true
	}
	for _, s := range append(append([]string{}, bwrap.System...), m.System...) {
		if under(h, s) {
			return true
		}
	}
	return false
}

func under(p, dir string) bool {
	return p == dir || strings.HasPrefix(p, strings.TrimSuffix(dir, "/")+"/")
}

// RunKeeper is `stasis sandbox keeper --dir DIR`: it runs the sandbox's
// bubblewrap, records the sandbox's init in DIR/keeper.json, and kills the
// sandbox at its absolute expiry (re-read from DIR/meta.json on SIGHUP) or
// when asked to (SIGTERM). It returns the process exit code.
func RunKeeper(dir string, log *slog.Logger) int {
	if err := keep(dir, log); err != nil {
		log.Error("keeper failed", "dir", dir, "err", err)
		return 1
	}
	return 0
}

func readMetaAt(dir string) (meta, error) {
	return hostkeep.ReadJSON[meta](filepath.Join(dir, hostkeep.MetaFile))
}

func keep(dir string, log *slog.Logger) error {
	m, err := readMetaAt(dir)
	if err != nil {
		return err
	}
	stageDir := ""
	if m.UIDBase != 0 {
		if stageDir, err = chooseStage(dir, m); err != nil {
			return err
		}
	}
	args, sources, err := bwrapArgs(dir, m, stageDir)
	if err != nil {
		return err
	}
	if stageDir != "" {
		if err := stage(stageDir, sources); err != nil {
			return err
		}
	}
	infoR, infoW, err := os.Pipe()
	if err != nil {
		return err
	}
	readyR, readyW, err := os.Pipe()
	if err != nil {
		return err
	}
	// The keeper joins the sandbox's control groups first, so that
	// bubblewrap and everything it starts are in them.
	if err := m.Cgroups.join(); err != nil {
		return fmt.Errorf("limits: %w", err)
	}
	sigs := hostkeep.Signals()
	cmd := exec.Command("bwrap", args...)
	cmd.SysProcAttr = m.userNamespace()
	cmd.ExtraFiles = []*os.File{infoW, readyW}
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start bwrap: %w", err)
	}
	infoW.Close()
	readyW.Close()
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()

	var info struct {
		ChildPID int `json:"child-pid"`
	}
	_ = infoR.SetReadDeadline(time.Now().Add(20 * time.Second))
	b, err := io.ReadAll(bufio.NewReader(infoR))
	infoR.Close()
	if err == nil {
		err = json.Unmarshal(b, &info)
	}
	if err != nil || info.ChildPID <= 0 {
		_ = cmd.Process.Kill()
		<-exited
		return fmt.Errorf("bwrap did not report the sandbox's pid (%v, %q)", err, b)
	}
	_ = readyR.SetReadDeadline(time.Now().Add(20 * time.Second))
	line, err := bufio.NewReader(readyR).ReadString('\n')
	readyR.Close()
	if err != nil || strings.TrimSpace(line) != "ready" {
		_ = cmd.Process.Kill()
		<-exited
		return fmt.Errorf("the sandbox did not come up (%v, %q)", err, line)
	}
	self, err := proc.Self()
	if err != nil {
		return err
	}
	initID, err := proc.IdentityOf(info.ChildPID)
	if err != nil {
		return fmt.Errorf("the sandbox's init %d: %w", info.ChildPID, err)
	}
	bwrapID, _ := proc.IdentityOf(cmd.Process.Pid) // gone already only if the sandbox failed
	if err := atomicfile.WriteJSON(filepath.Join(dir, hostkeep.KeeperFile), keeperInfo{Keeper: self, Init: initID, Bwrap: bwrapID}, 0o600); err != nil {
		_ = cmd.Process.Kill()
		<-exited
		return err
	}
	log.Info("sandbox running", "id", m.ID, "init", initID.PID, "expiry", m.Expiry)

	kill := func(reason string) {
		log.Info("killing the sandbox", "id", m.ID, "reason", reason)
		_ = unix.Kill(initID.PID, unix.SIGKILL) // PID 1 of the namespace: takes every process with it
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
	}
	// A limit exceeded ends the sandbox as a stop request does; the reason
	// is in DIR/limit.json.
	stopWatch := make(chan struct{})
	defer close(stopWatch)
	if len(m.Cgroups.Dirs) > 0 {
		go watchLimits(dir, m, stopWatch, func() {
			log.Warn("a limit was exceeded: ending the sandbox", "id", m.ID)
			_ = unix.Kill(os.Getpid(), unix.SIGTERM)
		})
	}
	readExpiry := func() (time.Time, error) {
		nm, err := readMetaAt(dir)
		return nm.Expiry, err
	}
	return hostkeep.Loop(m.ID, m.Expiry, readExpiry, sigs, exited, kill, filepath.Join(dir, hostkeep.ExpiredFile), filepath.Join(dir, hostkeep.LogFile), log)
}
