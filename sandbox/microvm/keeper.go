package microvm

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"stasis/atomicfile"
	"stasis/proc"
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
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGHUP, syscall.SIGTERM, syscall.SIGINT)
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
	if err := atomicfile.WriteJSON(filepath.Join(dir, keeperFile), keeperInfo{Keeper: self, QEMU: qid}, 0o600); err != nil {
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
	for {
		timer := time.NewTimer(time.Until(m.Expiry))
		select {
		case <-timer.C:
			// Mark first: from now on the host refuses the sandbox.
			_ = atomicfile.Write(filepath.Join(dir, expiredFile), []byte(time.Now().UTC().Format(time.RFC3339Nano)+"\n"), 0o600)
			kill("expired")
			return nil
		case s := <-sigs:
			timer.Stop()
			if s == syscall.SIGHUP {
				nm, err := readMetaAt(dir)
				if err != nil {
					log.Warn("re-read meta.json", "err", err)
					continue
				}
				m.Expiry = nm.Expiry
				log.Info("expiry changed", "id", m.ID, "expiry", m.Expiry)
				continue
			}
			kill("asked to stop")
			return nil
		case err := <-exited:
			timer.Stop()
			var ee *exec.ExitError
			if err == nil || errors.As(err, &ee) {
				return fmt.Errorf("QEMU ended on its own (%v); see %s", err, filepath.Join(dir, qemuLogFile))
			}
			return err
		}
	}
}
