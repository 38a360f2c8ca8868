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
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"stasis/atomicfile"
	"stasis/internal/bwrap"
	"stasis/proc"
	"stasis/sandbox/hostkeep"
)

// bwrapArgs builds the bubblewrap command line for a sandbox directory.
//
// The root is a fresh tmpfs holding read-only binds of every top-level entry
// of the host root (symlinks recreated as symlinks), so that /work, /tmp and
// $HOME can be mount points whether or not the host has them; it is made
// read-only at the end. /proc is the sandbox's own, /dev a minimal one, and
// there is no network but loopback.
func bwrapArgs(dir string, m meta) ([]string, error) {
	hostRoot, err := bwrap.HostRoot("/work", "/tmp", m.Home)
	if err != nil {
		return nil, err
	}
	args := []string{
		"--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net", "--unshare-cgroup-try",
		"--die-with-parent", "--hostname", m.ID,
	}
	args = append(args, hostRoot...)
	args = append(args, "--proc", "/proc", "--dev", "/dev")
	for _, h := range m.Hide {
		if h == "" || under(h, "/tmp") || under(h, m.Home) || under(h, "/work") {
			continue // already hidden by a writable place bound over it
		}
		if _, err := os.Stat(h); err == nil {
			args = append(args, "--tmpfs", h)
		}
	}
	root := filepath.Join(dir, rootDir)
	args = append(args,
		"--bind", filepath.Join(root, "work"), "/work",
		"--bind", filepath.Join(root, "home"), m.Home,
		"--bind", filepath.Join(root, "tmp"), "/tmp",
	)
	for _, b := range m.Binds {
		args = append(args, "--bind", b, b)
	}
	dsts := make([]string, 0, len(m.ROBinds))
	src := map[string]string{}
	for h, d := range m.ROBinds {
		if !filepath.IsAbs(d) || !filepath.IsAbs(h) || under(d, "/work") || under(d, "/tmp") || under(d, m.Home) || filepath.Clean(d) == "/" {
			return nil, fmt.Errorf("read-only bind %s → %s: both paths must be absolute, and the sandbox path outside /, /work, /tmp and %s", h, d, m.Home)
		}
		dsts = append(dsts, d)
		src[d] = h
	}
	sort.Strings(dsts) // parents before children
	for _, d := range dsts {
		args = append(args, "--ro-bind", src[d], d)
	}
	// The holder says "ready" on fd 4 once it runs, that is once bubblewrap
	// has built the whole root (the info on fd 3 comes earlier than that).
	args = append(args, "--remount-ro", "/", "--chdir", "/work", "--info-fd", "3", "--",
		"/bin/sh", "-c", `echo ready >&4; exec 4>&-; exec sleep infinity`)
	return args, nil
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
	var m meta
	b, err := os.ReadFile(filepath.Join(dir, metaFile))
	if err != nil {
		return m, err
	}
	return m, json.Unmarshal(b, &m)
}

func keep(dir string, log *slog.Logger) error {
	m, err := readMetaAt(dir)
	if err != nil {
		return err
	}
	args, err := bwrapArgs(dir, m)
	if err != nil {
		return err
	}
	infoR, infoW, err := os.Pipe()
	if err != nil {
		return err
	}
	readyR, readyW, err := os.Pipe()
	if err != nil {
		return err
	}
	sigs := hostkeep.Signals()
	cmd := exec.Command("bwrap", args...)
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
	if err := atomicfile.WriteJSON(filepath.Join(dir, keeperFile), keeperInfo{Keeper: self, Init: initID, Bwrap: bwrapID}, 0o600); err != nil {
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
	readExpiry := func() (time.Time, error) {
		nm, err := readMetaAt(dir)
		return nm.Expiry, err
	}
	return hostkeep.Loop(m.ID, m.Expiry, readExpiry, sigs, exited, kill, filepath.Join(dir, expiredFile), filepath.Join(dir, logFile), log)
}
