/*
 * protocol.pml: a model of stasis's checkpoint protocol, for spin.
 *
 * It models what coordinator.go (Prepare, Restore, Retire, New), the
 * supervisor's pause and continue (internal/insandbox/supervisor/machine.go), the relay's hold
 * and delivery (internal/control/relay/relay.go, internal/control/relay/call.go), the gateway's ledger cut
 * (internal/control/relay/gateway.go), the record store (internal/storage/store/) and a server's start on an
 * existing state (server.New: provider GC, RecoverPending, coordinator.New,
 * continueLeftPaused) do, with a crash of any party at any step.
 * TestProtocolModel (protocol_test.go) checks it with spin, and checks that
 * each BROKEN_ variant below fails the invariant it breaks.
 *
 * Processes:
 *   server     the coordinator of one `stasis serve`: prepare (pause every
 *              live episode, snapshot it, put its record; commit in one
 *              step; continue), restore (retire the live episodes the
 *              checkpoint names, validate every record, fork every
 *              snapshot, cut each ledger and resume in place, then install
 *              every episode in one step, or delete every fork), and after
 *              a crash, recovery: a new server on the same state
 *   harnesses  each sandbox's harness, supervisor and relay: a model call is
 *              answered and recorded in the ledger at the gateway (durable
 *              before visible); a delivery starts; a delivery finishes (the
 *              harness has the response, relay_delivered counts it)
 *   crasher    a crash of the server (its memory and the operation it was
 *              in are lost; the sandboxes run on), of the host (the server
 *              and every sandbox: their keepers die; the store, the ledgers
 *              and the snapshots are on disk), or of one sandbox (its
 *              supervisor, relay and harness): any of them, at any step
 *   monitor    the three invariants, checked in every reachable state
 * The record store, the provider (sandboxes, snapshots) and the gateway
 * (ledgers, attempts) are the global state below; each of their operations
 * is one atomic step (one SQL transaction, one provider call, one ledger
 * write), so a crash falls between operations, never inside one.
 *
 * Bounds and abstractions: two episodes, two prepares, two restores, a
 * ledger of at most MAXC entries (1 by default: one model call between
 * cuts), MAXCRASH crashes (1 by default, plus a second crash of the server
 * during the recovery from the first, so that recovery is shown to be
 * idempotent). Every snapshot keeps processes and every restore resumes in
 * place (the relaunch path and its ledger matching are not modelled); the
 * harness never ends (no verify, no finished records) and its client never
 * goes away (no abandoned responses: relay_position is relay_delivered);
 * pause modes are one (the relay is held, then the harness stopped, in one
 * acknowledgement; a stop that is not confirmed is left out);
 * the episodes of a prepare or a restore are worked on one after the other
 * rather than with bounded concurrency; a provider fails only by a dead
 * sandbox or a fork that fails; episode starts, branches, deleting
 * checkpoints and expiry are left out. A ledger entry is represented by the
 * attempt that recorded it: within one attempt each position is recorded
 * once, so (position, attempt) names an entry as the ledger's hash chain
 * does.
 *
 * Invariants (the README names them; monitor asserts, one flag each):
 *   restorable   a committed checkpoint is always restorable
 *   noleak       no sandbox is retired twice or leaked
 *   cutreceived  the ledger cut equals what the harness received
 *
 * Broken variants (spin -DNAME), each failing the invariant named:
 *   BROKEN_COMMIT_BEFORE_RECORDS  the commit does not wait for every
 *                                 record                     -> restorable
 *   BROKEN_CUT_AFTER_DELIVERY     a pause takes the ledger cut without
 *                                 waiting for a delivery under way
 *                                                            -> cutreceived
 *   BROKEN_NO_RECOVERY_GC         recovery leaves the snapshots and forks
 *                                 an interrupted prepare or restore made
 *                                 (what the code does today)  -> noleak
 *   BROKEN_NO_SNAPSHOT_GC,        one half of it each: the snapshots an
 *   BROKEN_NO_FORK_GC             interrupted prepare took; the forks an
 *                                 interrupted restore made    -> noleak
 *   BROKEN_CUT_BY_POSITION        an in-place restore cuts the ledger by
 *                                 position alone (what the gateway does
 *                                 today)                      -> cutreceived
 *
 * Where the model does what the code does not do yet, it says INTENDED.
 *
 * By hand, as the test does (add -DNAME for a variant):
 *   spin -a protocol.pml && gcc -O2 -DSAFETY -DCOLLAPSE -o pan pan.c && ./pan -m10000 -w20
 * The default bounds give about 0.8 million states, a few seconds; larger
 * ones hold too and take longer: -DMAXCRASH=2 (about 5 million states),
 * -DMAXC=2 (about 5.5 million).
 */

#ifdef BROKEN_NO_RECOVERY_GC
#define BROKEN_NO_SNAPSHOT_GC
#define BROKEN_NO_FORK_GC
#endif

#define NE        2             /* episodes */
#define NR        2             /* prepares */
#define NRESTORE  2             /* restores */
#define NSB       6             /* sandboxes: NE at the start, NE forks per restore */
#define NSN       4             /* snapshots: episode e's of prepare r is r*NE+e */
#ifndef MAXC
#define MAXC      1             /* ledger entries per episode (1 or 2) */
#endif
#ifndef MAXCRASH
#define MAXCRASH  1             /* crashes, besides one of the server while it recovers */
#endif
#define NIL       255

/* sandbox states */
#define SB_NONE   0             /* not made */
#define SB_ALIVE  1
#define SB_DEAD   2             /* its keeper died; the provider still has it */
#define SB_GONE   3             /* deleted */
/* snapshot states */
#define SN_NONE   0
#define SN_EXISTS 1
#define SN_GONE   2
/* checkpoint states (store.State) */
#define CK_NONE      0
#define CK_PENDING   1
#define CK_COMMITTED 2
#define CK_FAILED    3
/* episode rows (store.Episode.State) */
#define EP_RUNNING 1
#define EP_LOST    2
#define EP_RETIRED 3
/* crashes */
#define CR_NONE   0
#define CR_SERVER 1
#define CR_HOST   2

/* The provider's sandboxes, each with its supervisor, relay and harness. */
byte sbst[NSB];
byte sbdel[NSB];                /* Delete calls that reached the provider */
byte sbep[NSB];                 /* the episode it runs */
bit  held[NSB];                 /* paused: the relay holds, the harness is stopped */
bit  dlv[NSB];                  /* the relay is writing a response to the harness */
byte deliv[NSB];                /* responses the harness received whole (relay_delivered) */
byte att[NSB];                  /* the attempt its relay's credentials name */
byte conv[NSB * MAXC];          /* the harness's conversation: the entry of each response */
byte nsb;                       /* the next sandbox id (ids are never reused) */

/* The provider's snapshots: what the harness and its relay held. */
byte snst[NSN];
byte sndel[NSN];
byte sndeliv[NSN];
bit  sndlv[NSN];
byte snatt[NSN];
byte snconv[NSN * MAXC];

/* The record store: checkpoints, their records, the episode rows. */
byte ck[NR];
byte ckn[NR];                   /* the records its commit counted */
bit  rec[NSN];                  /* episode e's record in checkpoint r: r*NE+e */
byte reccut[NSN];               /* its ledger position (relay_delivered) */
byte rechead[NSN];              /* the ledger's entry there (INTENDED: the chain's hash) */
byte epst[NE];
byte epsb[NE];

/* The gateway: each episode's ledger and attempt. */
byte led[NE];
byte ltag[NE * MAXC];
byte gatt[NE];

/* The server's memory, lost in a crash: the live episodes. */
bit live[NE];

byte rounds;
byte restores;
bit  finished;                  /* the server is done and idle */
byte crash;                     /* a crash the server has not yet fallen to */
byte crashes;
bit  recovering;                /* a new server has not finished its start */

/* The invariants' flags: the monitor clears one and asserts it. */
bit restorable = 1;
bit noleak = 1;
bit cutreceived = 1;

/* a committed checkpoint is always restorable: its records are all there
 * (as many as its commit counted) and each names a snapshot that exists */
#define RECOK(n)   (!rec[n] || snst[n] == SN_EXISTS)
#define CKOK(r)    (ck[r] != CK_COMMITTED || \
                    (rec[(r)*NE] + rec[(r)*NE+1] == ckn[r] && RECOK((r)*NE) && RECOK((r)*NE+1)))
#define RESTORABLE (CKOK(0) && CKOK(1))

/* no sandbox is retired twice or leaked: no sandbox or snapshot is deleted
 * twice; and once the server is done, every sandbox made is deleted once or
 * named by a running episode, and every snapshot made is deleted once or
 * named by a committed checkpoint */
#define NAMED(s)   ((epst[0] == EP_RUNNING && epsb[0] == s) || (epst[1] == EP_RUNNING && epsb[1] == s))
#define SBOK(s)    (sbdel[s] <= 1 && (!finished || sbst[s] == SB_NONE || \
                    (sbst[s] == SB_GONE && sbdel[s] == 1) || (sbst[s] != SB_GONE && NAMED(s))))
#define SNOK(n)    (sndel[n] <= 1 && (!finished || snst[n] == SN_NONE || \
                    (snst[n] == SN_GONE && sndel[n] == 1) || \
                    (snst[n] == SN_EXISTS && ck[(n)/NE] == CK_COMMITTED && rec[n])))
#define NOLEAK     (SBOK(0) && SBOK(1) && SBOK(2) && SBOK(3) && SBOK(4) && SBOK(5) && \
                    SNOK(0) && SNOK(1) && SNOK(2) && SNOK(3))

/* the ledger cut equals what the harness received: a record's position is
 * the count of responses its snapshot's harness has, none half delivered;
 * and a running episode's ledger begins with exactly the responses its
 * harness has (after a restore: the cut ledger is what the restored
 * harness received) */
#define CUTOK(n)   (!rec[n] || (reccut[n] == sndeliv[n] && !sndlv[n]))
#if MAXC > 1
#define SECOND(e)  (deliv[epsb[e]] < 2 || conv[epsb[e]*MAXC+1] == ltag[(e)*MAXC+1])
#else
#define SECOND(e)  true
#endif
#define CONVOK(e)  (epst[e] != EP_RUNNING || sbst[epsb[e]] != SB_ALIVE || \
                    (deliv[epsb[e]] <= led[e] && \
                     (deliv[epsb[e]] < 1 || conv[epsb[e]*MAXC] == ltag[(e)*MAXC]) && SECOND(e)))
#define CUTRECEIVED (CUTOK(0) && CUTOK(1) && CUTOK(2) && CUTOK(3) && CONVOK(0) && CONVOK(1))

/* A pause (supervisor.Machine.Pause, relay.Hold) answers with its
 * relay_delivered only once no delivery is under way. */
#ifdef BROKEN_CUT_AFTER_DELIVERY
#define CUT_READY(s) true
#else
#define CUT_READY(s) (!dlv[s])
#endif

/* An in-place restore's ledger cut (relay.Gateway.Restore). The gateway
 * today checks only that the position is within the ledger. INTENDED: the
 * record also carries the ledger's entry (its hash) at the position, and
 * the gateway refuses the cut when the ledger holds another history there
 * (a restore of an earlier checkpoint cut it and the episode went on). */
#ifdef BROKEN_CUT_BY_POSITION
#define CUT_OK(e, n) (reccut[n] <= led[e])
#else
#define CUT_OK(e, n) (reccut[n] <= led[e] && (reccut[n] == 0 || ltag[(e)*MAXC + reccut[n] - 1] == rechead[n]))
#endif

/* What is left of a deleted or dead sandbox is nobody's. */
inline forget(x) {
	held[x] = 0; dlv[x] = 0; deliv[x] = 0; att[x] = 0;
	conv[(x)*MAXC] = 0;
#if MAXC > 1
	conv[(x)*MAXC+1] = 0
#endif
}

/* Provider.Delete, as coordinator.deleteSandbox calls it: a sandbox
 * already gone is not deleted again. In a d_step. */
inline delete_sandbox(x) {
	if
	:: sbst[x] == SB_ALIVE || sbst[x] == SB_DEAD -> sbdel[x]++; sbst[x] = SB_GONE; forget(x)
	:: else -> skip
	fi
}

/* Prepare's part for episode E: pause N, whose acknowledgement carries
 * relay_delivered; snapshot; Store.Put. An episode whose sandbox does not
 * answer is a straggler, left out (StragglersExclude). */
inline prepare_one(E) {
	if
	:: d_step { live[E] && sbst[epsb[E]] == SB_ALIVE && CUT_READY(epsb[E]) ->
			held[epsb[E]] = 1; cut = deliv[epsb[E]]; pmask = pmask | (1 << E) }
		if
		:: d_step { sbst[epsb[E]] == SB_ALIVE ->
				n = r*NE + E; snst[n] = SN_EXISTS;
				sndeliv[n] = deliv[epsb[E]]; sndlv[n] = dlv[epsb[E]]; snatt[n] = att[epsb[E]];
				snconv[n*MAXC] = conv[epsb[E]*MAXC];
#if MAXC > 1
				snconv[n*MAXC+1] = conv[epsb[E]*MAXC+1];
#endif
				n = 0 }
			d_step {
				n = r*NE + E; rec[n] = 1; reccut[n] = cut;
				rechead[n] = (cut > 0 -> ltag[E*MAXC + cut - 1] : 0);
				nput++; n = 0; cut = 0 }
		:: d_step { sbst[epsb[E]] != SB_ALIVE -> cut = 0 }
		fi
	:: d_step { !(live[E] && sbst[epsb[E]] == SB_ALIVE) -> skip }
	fi
}

/* continue N, if episode E's pause is in force (a dead sandbox: given up). */
inline continue_one(E) {
	d_step {
		if
		:: (pmask & (1 << E)) && sbst[epsb[E]] == SB_ALIVE -> held[epsb[E]] = 0
		:: else -> skip
		fi
	}
}

inline drop_snapshot(n) {
	d_step {
		if
		:: snst[n] == SN_EXISTS -> sndel[n]++; snst[n] = SN_GONE
		:: else -> skip
		fi
	}
}

/* Coordinator.Prepare. */
inline prepare() {
	d_step { r = rounds; rounds++; ck[r] = CK_PENDING }       /* Store.Begin */
#ifdef BROKEN_COMMIT_BEFORE_RECORDS
	d_step { ck[r] = CK_COMMITTED; ckn[r] = live[0] + live[1] }
#endif
	prepare_one(0);
	prepare_one(1);
	/* Store.Commit: exactly the records put, in one transaction; with
	 * none (every episode straggled), Store.Fail */
	d_step {
		if
		:: nput > 0 && ck[r] == CK_PENDING && rec[r*NE] + rec[r*NE+1] == nput ->
			ck[r] = CK_COMMITTED; ckn[r] = nput
		:: else ->
			failing = 1;
			if
			:: ck[r] == CK_PENDING -> ck[r] = CK_FAILED
			:: else -> skip
			fi
		fi
	}
	continue_one(0);
	continue_one(1);
	/* a failed checkpoint's snapshots are deleted */
	if
	:: failing -> drop_snapshot(r*NE); drop_snapshot(r*NE + 1)
	:: else -> skip
	fi;
	atomic { r = 0; pmask = 0; nput = 0; failing = 0 }
}

/* Retire of episode E if the checkpoint names it and it is live (a
 * restore refuses a live episode): out of the live map, Episode.Close
 * deletes its sandbox, PutEpisode marks it retired. */
inline retire_one(E) {
	if
	:: d_step { rec[r*NE + E] && live[E] -> live[E] = 0; delete_sandbox(epsb[E]) }
		d_step { epst[E] = EP_RETIRED }
	:: d_step { !(rec[r*NE + E] && live[E]) -> skip }
	fi
}

/* Provider.Fork of episode E's snapshot, or a fork that fails. */
inline fork_one(E) {
	if
	:: d_step { !failing && rec[r*NE + E] ->
			n = r*NE + E; f = nsb; nsb++;
			sbst[f] = SB_ALIVE; sbep[f] = E; held[f] = 1;
			deliv[f] = sndeliv[n]; dlv[f] = sndlv[n]; att[f] = snatt[n];
			conv[f*MAXC] = snconv[n*MAXC];
#if MAXC > 1
			conv[f*MAXC+1] = snconv[n*MAXC+1];
#endif
			fk[E] = f; n = 0; f = 0 }
	:: d_step { !failing && rec[r*NE + E] -> failing = 1 }
	:: d_step { failing || !rec[r*NE + E] -> skip }
	fi
}

/* Resume episode E in place: the gateway cuts its ledger to the record's
 * position and raises the attempt, the fork's relay gets the new
 * credentials, continue N. */
inline resume_one(E) {
	if
	:: d_step { !failing && rec[r*NE + E] && sbst[fk[E]] == SB_ALIVE && CUT_OK(E, r*NE + E) ->
			led[E] = reccut[r*NE + E]; gatt[E]++; att[fk[E]] = gatt[E];
			if
			:: led[E] < 1 -> ltag[E*MAXC] = 0
			:: else -> skip
			fi;
#if MAXC > 1
			if
			:: led[E] < 2 -> ltag[E*MAXC+1] = 0
			:: else -> skip
			fi
#endif
		}
		if
		:: d_step { sbst[fk[E]] == SB_ALIVE -> held[fk[E]] = 0 }
		:: d_step { sbst[fk[E]] != SB_ALIVE -> failing = 1 }
		fi
	:: d_step { !failing && rec[r*NE + E] && !(sbst[fk[E]] == SB_ALIVE && CUT_OK(E, r*NE + E)) -> failing = 1 }
	:: d_step { failing || !rec[r*NE + E] -> skip }
	fi
}

/* The caller retires the live episodes checkpoint r names, then
 * Coordinator.Restore: validate every record before touching the
 * provider, fork every snapshot, resume each; all or nothing. */
inline restore() {
	if
	:: d_step { ck[0] == CK_COMMITTED && (rec[0] || rec[1]) -> r = 0; restores++ }
	:: d_step { ck[1] == CK_COMMITTED && (rec[2] || rec[3]) -> r = 1; restores++ }
	fi;
	retire_one(0);
	retire_one(1);
	d_step {
		if
		:: (rec[r*NE] && snst[r*NE] != SN_EXISTS) || (rec[r*NE+1] && snst[r*NE+1] != SN_EXISTS) ->
			failing = 1          /* refused: nothing changed */
		:: else -> skip
		fi
	}
	fork_one(0);
	fork_one(1);
	resume_one(0);
	resume_one(1);
	if
	:: d_step { !failing ->                  /* Store.PutEpisodes, one transaction */
			if
			:: rec[r*NE] -> epst[0] = EP_RUNNING; epsb[0] = fk[0]; live[0] = 1
			:: else -> skip
			fi;
			if
			:: rec[r*NE+1] -> epst[1] = EP_RUNNING; epsb[1] = fk[1]; live[1] = 1
			:: else -> skip
			fi }
	:: failing ->                            /* every fork it made deleted */
		d_step { if :: fk[0] != 0 -> delete_sandbox(fk[0]) :: else -> skip fi }
		d_step { if :: fk[1] != 0 -> delete_sandbox(fk[1]) :: else -> skip fi }
	fi;
	atomic { r = 0; failing = 0; fk[0] = 0; fk[1] = 0 }
}

/* A new server on the same state (server.New), after a crash. Each phase
 * is one step; they are idempotent, so a crash inside one is as a crash
 * before it. */
inline recover() {
	/* the provider's GC: sandboxes whose keeper died are deleted */
	d_step {
		for (i : 0 .. NSB-1) {
			if
			:: sbst[i] == SB_DEAD -> sbdel[i]++; sbst[i] = SB_GONE
			:: else -> skip
			fi
		}
		i = 0
	}
	/* Store.RecoverPending: a pending checkpoint was the dead server's */
	d_step {
		for (i : 0 .. NR-1) {
			if
			:: ck[i] == CK_PENDING -> ck[i] = CK_FAILED
			:: else -> skip
			fi
		}
		i = 0
	}
#ifndef BROKEN_NO_SNAPSHOT_GC
	/* INTENDED: a prepare journals each snapshot in the store before it
	 * takes it (its name, EPISODE-pSEQ, is known beforehand); those that
	 * no committed checkpoint names are deleted */
	d_step {
		for (i : 0 .. NSN-1) {
			if
			:: snst[i] == SN_EXISTS && !(ck[i/NE] == CK_COMMITTED && rec[i]) -> sndel[i]++; snst[i] = SN_GONE
			:: else -> skip
			fi
		}
		i = 0
	}
#endif
#ifndef BROKEN_NO_FORK_GC
	/* INTENDED: a restore journals each fork likewise; those that no
	 * episode row names are deleted, running or dead (one may have died
	 * since the GC) */
	d_step {
		for (i : 0 .. NSB-1) {
			if
			:: (sbst[i] == SB_ALIVE || sbst[i] == SB_DEAD) && !NAMED(i) -> sbdel[i]++; sbst[i] = SB_GONE; forget(i)
			:: else -> skip
			fi
		}
		i = 0
	}
#endif
	/* coordinator.New: a running episode whose sandbox runs is attached
	 * again; any other is lost, and what is left of a dead sandbox (one
	 * that died since the GC) is deleted */
	d_step {
		for (i : 0 .. NE-1) {
			if
			:: epst[i] == EP_RUNNING && sbst[epsb[i]] == SB_ALIVE -> live[i] = 1
			:: epst[i] == EP_RUNNING && sbst[epsb[i]] != SB_ALIVE ->
				delete_sandbox(epsb[i]); epst[i] = EP_LOST; epsb[i] = NIL
			:: else -> skip
			fi
		}
		i = 0
	}
	/* continueLeftPaused */
	d_step {
		for (i : 0 .. NE-1) {
			if
			:: live[i] && held[epsb[i]] -> held[epsb[i]] = 0
			:: else -> skip
			fi
		}
		i = 0;
		recovering = 0
	}
}

proctype server() {
	byte r, n, f, i, cut, pmask, nput;
	byte fk[NE];
	bit failing;
restart:
	{
		if
		:: recovering -> recover()
		:: else -> skip
		fi;
		do
		:: rounds < NR && (live[0] || live[1]) -> prepare()
		:: restores < NRESTORE && ((ck[0] == CK_COMMITTED && (rec[0] || rec[1])) ||
		                           (ck[1] == CK_COMMITTED && (rec[2] || rec[3]))) -> restore()
		:: break
		od;
		/* a prepare, a restore or a start leaves no running episode paused */
		assert(!(live[0] && sbst[epsb[0]] == SB_ALIVE && held[epsb[0]]) &&
		       !(live[1] && sbst[epsb[1]] == SB_ALIVE && held[epsb[1]]));
		finished = 1;
end_idle:
		false
	} unless {
		crash != CR_NONE -> d_step {
			crash = CR_NONE; finished = 0; recovering = 1;
			live[0] = 0; live[1] = 0;
			r = 0; n = 0; f = 0; i = 0; cut = 0; pmask = 0; nput = 0;
			fk[0] = 0; fk[1] = 0; failing = 0
		}
	};
	goto restart
}

/* Sandbox s's harness and relay. The harness makes a call once it has
 * every response so far; its answer is recorded at the gateway, which
 * hears only the current attempt's relay. A delivery starts only while the
 * relay is not held; one under way finishes even during a hold. */
#define HARNESS(s) \
	:: d_step { sbst[s] == SB_ALIVE && !held[s] && !dlv[s] && deliv[s] == led[sbep[s]] && led[sbep[s]] < MAXC && \
	            att[s] == gatt[sbep[s]] -> ltag[sbep[s]*MAXC + led[sbep[s]]] = att[s]; led[sbep[s]]++ } \
	:: d_step { sbst[s] == SB_ALIVE && !held[s] && !dlv[s] && deliv[s] < led[sbep[s]] && \
	            att[s] == gatt[sbep[s]] -> dlv[s] = 1 } \
	:: d_step { sbst[s] == SB_ALIVE && dlv[s] -> \
	            conv[s*MAXC + deliv[s]] = ltag[sbep[s]*MAXC + deliv[s]]; deliv[s]++; dlv[s] = 0 }

proctype harnesses() {
end:
	do
	HARNESS(0)
	HARNESS(1)
	HARNESS(2)
	HARNESS(3)
	HARNESS(4)
	HARNESS(5)
	od
}

#define KILL(s) \
	:: d_step { sbst[s] == SB_ALIVE -> crashes++; sbst[s] = SB_DEAD; forget(s) }

/* Up to MAXCRASH crashes of any kind, then one more of the server while
 * it recovers (so recovery is shown to be safe to start again). */
proctype crasher() {
	byte i;
	do
	:: crashes < MAXCRASH && crash == CR_NONE ->
		if
		:: d_step { crashes++; crash = CR_SERVER }
		:: d_step {
			crashes++; crash = CR_HOST;
			for (i : 0 .. NSB-1) {
				if
				:: sbst[i] == SB_ALIVE -> sbst[i] = SB_DEAD; forget(i)
				:: else -> skip
				fi
			}
			i = 0 }
		KILL(0)
		KILL(1)
		KILL(2)
		KILL(3)
		KILL(4)
		KILL(5)
		fi
	:: d_step { crashes == MAXCRASH && crash == CR_NONE && recovering -> crashes++; crash = CR_SERVER }
	:: break
	od
}

proctype monitor() {
end:
	if
	:: atomic { !RESTORABLE -> restorable = 0; assert(restorable) }
	:: atomic { !NOLEAK -> noleak = 0; assert(noleak) }
	:: atomic { !CUTRECEIVED -> cutreceived = 0; assert(cutreceived) }
	fi
}

init {
	byte i;
	d_step {
		nsb = NE;
		for (i : 0 .. NE-1) {
			sbst[i] = SB_ALIVE; sbep[i] = i; att[i] = 1;
			epst[i] = EP_RUNNING; epsb[i] = i; live[i] = 1; gatt[i] = 1
		}
		i = 0
	}
	atomic { run server(); run harnesses(); run crasher(); run monitor() }
}
