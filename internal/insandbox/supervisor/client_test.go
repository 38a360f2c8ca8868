package supervisor

import (
	"context"
	"net"
	"path/filepath"
	"testing"

	"stasis/internal/storage/atomicfile"
)

// A supervisor that ends between accepting a connection and answering it
// (it writes its receipt, then closes its socket): Call answers from the
// receipt instead of failing with a broken pipe or an early EOF.
func TestCallAnswersFromTheReceiptWhenTheSupervisorEndsMidCall(t *testing.T) {
	dir := t.TempDir()
	code := 0
	if err := atomicfile.WriteJSON(filepath.Join(dir, ReceiptFile), Receipt{ReturnCode: &code, TimedOut: true}, 0o644); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("unix", filepath.Join(dir, SocketFile))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close() // ends without reading or answering
		}
	}()
	for i := 0; i < 20; i++ {
		r, err := Call(context.Background(), dir, Request{Op: OpStatus})
		if err != nil {
			t.Fatalf("status %d: %v", i, err)
		}
		if r.Status == nil || r.Status.State != "exited" || r.Status.Receipt == nil || !r.Status.Receipt.TimedOut {
			t.Fatalf("status %d: %+v, want exited with the receipt", i, r)
		}
	}
}
