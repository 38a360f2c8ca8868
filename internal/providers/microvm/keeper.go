package microvm

import (
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"stasis/internal/proc"
	"stasis/internal/providers/hostkeep"
	"stasis/internal/storage/atomicfile"
)

// RunKeeper is `stasis microvm keeper --dir DIR`: it runs the sandbox's
// QEMU, records both processes in DIR/keeper.json, and kills QEMU at the
// sandbox's absolute expiry (re-read from DIR/meta.json on SIGHUP) or when
// asked to (SIGTERM). QEMU does not die with the keeper: a killed keeper
// leaves a QEMU that GC finds (by keeper.json) and ends. It returns the
// process exit code.
func RunKeeper(dir string, log *slog.Logger) int {
	if err := keep(dir, log); err != nil {
		log.Error("keeper failed", "dir", dir, "err", err)
		return 1
	}
	return 0
}

func keep(dir string, log *slog.Logger) error {
	m, err := readMetaAt(dir)
	if err != nil {
		return err
	}
	sigs := hostkeep.Signals()
	qlog, err := os.OpenFile(filepath.Join(dir, qemuLogFile), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	defer qlog.Close()
	cmd := exec.Command(m.VM.QEMU, m.VM.args(dir)...)
	cmd.Dir = dir
	cmd.Stdout, cmd.Stderr = qlog, qlog
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", m.VM.QEMU, err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	self, err := proc.Self()
	if err != nil {
		_ = cmd.Process.Kill()
		<-exited
		return err
	}
	qid, err := proc.IdentityOf(cmd.Process.Pid)
	if err != nil {
		_ = cmd.Process.Kill()
		<-exited
		return fmt.Errorf("QEMU exited at once: %w", err)
	}
	if err := atomicfile.WriteJSON(filepath.Join(dir, hostkeep.KeeperFile), keeperInfo{Keeper: self, QEMU: qid}, 0o600); err != nil {
		_ = cmd.Process.Kill()
		<-exited
		return err
	}
	log.Info("microVM running", "id", m.ID, "qemu", qid.PID, "port", m.VM.Port, "accel", m.VM.Accel, "expiry", m.Expiry)
	kill := func(reason string) {
		log.Info("killing the microVM", "id", m.ID, "reason", reason)
		_ = unix.Kill(qid.PID, unix.SIGKILL)
		<-exited
	}
	readExpiry := func() (time.Time, error) {
		nm, err := readMetaAt(dir)
		return nm.Expiry, err
	}
	return hostkeep.Loop(m.ID, m.Expiry, readExpiry, sigs, exited, kill, filepath.Join(dir, hostkeep.ExpiredFile), filepath.Join(dir, qemuLogFile), log)
}
