/*
 * The ledger's fold in the JVM: the markers (and dead letters) of each logical message, sorted,
 * folded in one pass into the message's row before its final state is judged.
 *
 * Why it exists: in Spark SQL the fold is two aggregations whose buffers hold strings and
 * structs picked by position (the first START's record and consumer, the first outcome with its
 * reason, the history of attempts). Spark runs those as sort aggregates without code generation,
 * and compiling their wide expressions made a cold run cost three times a warm one
 * (docs/pipeline.md, "Plans tried"). The markers are already shuffled by message and sorted for
 * those aggregates; walking the sorted rows once, keeping the few values a message needs, does
 * the same fold with no aggregation buffer at all.
 *
 * It computes exactly what pipeline/ledger_fold.py's SQL fold computes (``_per_key_sql``), with
 * Spark's rules for nulls (an aggregate skips them, ``min_by`` takes the value of the least
 * position even when that value is null); tests/spark_pipeline/test_ledger_fold_jvm.py holds
 * the two to the same rows. The output schema is ledger_schemas.FOLDED_SCHEMA (the SQL
 * fold's; tests hold them equal), handed over as JSON, so the final projection that both
 * share sees the same columns; one thing is done here that the SQL path does in that
 * projection: an open attempt followed by a later one is marked ``timed_out`` in the history
 * (``_ledger_rows(timed_out_marked=True)``).
 *
 * Input columns, in this order (see ``_fold_input`` in ledger_fold.py): group, origin_topic,
 * origin_partition, origin_offset, src (0 a marker, 1 a dead letter), attempt,
 * markers_partition, markers_offset, ts (epoch ms), kind, topic, partition, offset, consumer,
 * timeout_ms, delay_ms, policy_delay, deferred, reason. A dead letter carries its time in ts,
 * its record in topic / partition / offset, its reason, and its ``attempts`` in attempt.
 */
package kmq.pipeline;

import java.time.Instant;
import java.util.ArrayList;
import java.util.Iterator;
import java.util.List;
import java.util.NoSuchElementException;
import java.util.Objects;
import org.apache.spark.api.java.function.MapPartitionsFunction;
import org.apache.spark.sql.Column;
import org.apache.spark.sql.Dataset;
import org.apache.spark.sql.Row;
import org.apache.spark.sql.RowFactory;
import org.apache.spark.sql.catalyst.encoders.ExpressionEncoder;
import org.apache.spark.sql.functions;
import org.apache.spark.sql.types.DataType;
import org.apache.spark.sql.types.StructType;
import scala.jdk.javaapi.CollectionConverters;

public final class LedgerFold implements MapPartitionsFunction<Row, Row> {
  private static final long serialVersionUID = 1L;

  private static final int GROUP = 0;
  private static final int ORIGIN_TOPIC = 1;
  private static final int ORIGIN_PARTITION = 2;
  private static final int ORIGIN_OFFSET = 3;
  private static final int SRC = 4;
  private static final int ATTEMPT = 5;
  private static final int MARKERS_PARTITION = 6;
  private static final int TS = 8;
  private static final int KIND = 9;
  private static final int TOPIC = 10;
  private static final int PARTITION = 11;
  private static final int OFFSET = 12;
  private static final int CONSUMER = 13;
  private static final int TIMEOUT_MS = 14;
  private static final int DELAY_MS = 15;
  private static final int POLICY_DELAY = 16;
  private static final int DEFERRED = 17;
  private static final int REASON = 18;

  private static final int SRC_DLQ = 1;

  private static final String[] KEY = {"group", "origin_topic", "origin_partition", "origin_offset"};
  /**
   * The sort within a shuffle partition: a message's rows together, its markers by attempt and
   * each attempt in write order, its dead letters apart. Which message comes first does not
   * matter, so the offset leads: Spark's sort compares an 8-byte prefix of the first column
   * first, and the group and topic, the same in most rows, would make every comparison a string
   * comparison.
   */
  private static final String[] ORDER = {
    "origin_offset",
    "origin_partition",
    "origin_topic",
    "group",
    "src",
    "attempt",
    "markers_partition",
    "markers_offset"
  };

  private final long defaultTimeoutMs;

  private LedgerFold(long defaultTimeoutMs) {
    this.defaultTimeoutMs = defaultTimeoutMs;
  }

  /**
   * The fold of ``rows`` (the input columns above) into one row per message with markers, of
   * ``schemaJson``'s shape. ``defaultTimeoutMs`` is the lease of a START whose timeout is 0.
   */
  public static Dataset<Row> fold(Dataset<Row> rows, String schemaJson, long defaultTimeoutMs) {
    StructType schema = (StructType) DataType.fromJson(schemaJson);
    Column[] key = new Column[KEY.length];
    for (int i = 0; i < KEY.length; i++) {
      key[i] = functions.col(KEY[i]);
    }
    Column[] order = new Column[ORDER.length];
    for (int i = 0; i < ORDER.length; i++) {
      order[i] = functions.col(ORDER[i]).asc_nulls_first();
    }
    // Lenient: timestamps go out as java.time.Instant whatever the session's java8API setting.
    return rows.repartition(key)
        .sortWithinPartitions(order)
        .mapPartitions(new LedgerFold(defaultTimeoutMs), ExpressionEncoder.apply(schema, true));
  }

  @Override
  public Iterator<Row> call(Iterator<Row> input) {
    return new Messages(input, defaultTimeoutMs);
  }

  /** One message's row at a time from the sorted rows of a partition. */
  private static final class Messages implements Iterator<Row> {
    private final Iterator<Row> input;
    private final long defaultTimeoutMs;
    private Row next; // the first row of the message not folded yet
    private Row ready; // the next row to hand out

    Messages(Iterator<Row> input, long defaultTimeoutMs) {
      this.input = input;
      this.defaultTimeoutMs = defaultTimeoutMs;
      this.next = input.hasNext() ? input.next() : null;
    }

    @Override
    public boolean hasNext() {
      while (ready == null && next != null) {
        ready = foldMessage();
      }
      return ready != null;
    }

    @Override
    public Row next() {
      if (!hasNext()) {
        throw new NoSuchElementException();
      }
      Row out = ready;
      ready = null;
      return out;
    }

    /** Fold the rows of the message ``next`` starts; null for dead letters with no marker. */
    private Row foldMessage() {
      Row first = next;
      Message message = new Message(defaultTimeoutMs);
      Row row = first;
      do {
        message.add(row);
        row = input.hasNext() ? input.next() : null;
      } while (row != null && sameKey(first, row));
      next = row;
      return message.toRow(first);
    }

    private static boolean sameKey(Row a, Row b) {
      return Objects.equals(a.get(ORIGIN_OFFSET), b.get(ORIGIN_OFFSET))
          && Objects.equals(a.get(ORIGIN_PARTITION), b.get(ORIGIN_PARTITION))
          && Objects.equals(a.get(ORIGIN_TOPIC), b.get(ORIGIN_TOPIC))
          && Objects.equals(a.get(GROUP), b.get(GROUP));
    }
  }

  /** What one message's rows add up to: ``per_key`` of the SQL fold. */
  private static final class Message {
    private final long defaultTimeoutMs;
    private Attempt attempt;
    private boolean hasMarkers;
    private Integer markersPartition;
    private Long firstSeenMs;
    private Long lastMarkerMs;
    private Long firstStartMs;
    private Integer attempts;
    private long deliveries;
    private final List<Attempt> history = new ArrayList<>(2);
    private Row latest;
    private Long totalProcessingMs;
    private Long totalDelayMs;
    private String lastReason;
    private int dlqRecords;
    private Row dlq;

    Message(long defaultTimeoutMs) {
      this.defaultTimeoutMs = defaultTimeoutMs;
    }

    void add(Row row) {
      if (row.getInt(SRC) == SRC_DLQ) {
        addDeadLetter(row);
        return;
      }
      Integer number = (Integer) row.get(ATTEMPT);
      if (attempt == null || !Objects.equals(attempt.number, number)) {
        finishAttempt();
        attempt = new Attempt(number);
      }
      hasMarkers = true;
      attempt.add(row, defaultTimeoutMs);
    }

    private void addDeadLetter(Row row) {
      dlqRecords++;
      Row candidate =
          RowFactory.create(
              row.get(TS),
              row.get(TOPIC),
              row.get(PARTITION),
              row.get(OFFSET),
              row.get(REASON),
              row.get(ATTEMPT));
      if (dlq == null || Order.compareRows(candidate, dlq) < 0) {
        dlq = candidate;
      }
    }

    private void finishAttempt() {
      if (attempt == null) {
        return;
      }
      Attempt a = attempt;
      attempt = null;
      markersPartition = Order.min(markersPartition, a.markersPartition);
      firstSeenMs = Order.min(firstSeenMs, a.firstMs);
      lastMarkerMs = Order.max(lastMarkerMs, a.lastMs);
      firstStartMs = Order.min(firstStartMs, a.startedMs);
      attempts = Order.max(attempts, a.number);
      deliveries += a.starts;
      Long processing = a.processingMs();
      totalProcessingMs = Order.sum(totalProcessingMs, processing);
      totalDelayMs = Order.sum(totalDelayMs, a.requestedDelayMs());
      history.add(a);
      if (a.number != null) { // attempts come in ascending order: the last one is the latest
        latest =
            RowFactory.create(
                a.outcomeKind(),
                a.outcome == null ? null : a.outcome.get(TS),
                a.outcome == null ? null : a.outcome.get(DELAY_MS),
                a.outcome == null ? null : a.outcome.get(POLICY_DELAY),
                a.deadlineMs,
                a.deferredDueMs,
                a.startedMs,
                processing);
        String reason = a.outcomeReason();
        if (reason != null) {
          lastReason = reason;
        }
      }
    }

    /** The message's row, or null when it has dead letters and no marker (left join). */
    Row toRow(Row keyRow) {
      finishAttempt();
      if (!hasMarkers) {
        return null;
      }
      // An open attempt followed by another one timed out: the SQL fold's final transform.
      List<Row> infos = new ArrayList<>(history.size());
      for (Attempt a : history) {
        boolean timedOut = a.number != null && attempts != null && a.number < attempts;
        infos.add(a.info(timedOut));
      }
      return RowFactory.create(
          keyRow.get(GROUP),
          keyRow.get(ORIGIN_TOPIC),
          keyRow.get(ORIGIN_PARTITION),
          keyRow.get(ORIGIN_OFFSET),
          markersPartition,
          firstSeenMs,
          lastMarkerMs,
          firstStartMs,
          attempts,
          (int) deliveries,
          CollectionConverters.asScala(infos), // a Seq, as the row encoder wants
          latest,
          totalProcessingMs,
          totalDelayMs,
          lastReason,
          dlqRecords,
          dlq);
    }
  }

  /** One attempt's markers: ``_per_attempt`` of the SQL fold. */
  private static final class Attempt {
    final Integer number;
    Integer markersPartition;
    Long firstMs;
    Long lastMs;
    Long startedMs;
    int starts;
    int extendsCount;
    Long deadlineMs; // at the last START / EXTEND with a lease (max_by position)
    Row firstStart; // the first START (its record and consumer)
    Row firstRow; // the first marker (its record, when no START came)
    Row outcome; // the first ACK, REJECT or non-deferred DELAY
    boolean deferredSeen;
    Long deferredDueMs; // the first deferred DELAY's due time

    Attempt(Integer number) {
      this.number = number;
    }

    void add(Row row, long defaultTimeoutMs) {
      Long ts = (Long) row.get(TS);
      markersPartition = Order.min(markersPartition, (Integer) row.get(MARKERS_PARTITION));
      firstMs = Order.min(firstMs, ts);
      lastMs = Order.max(lastMs, ts);
      if (firstRow == null) {
        firstRow = row;
      }
      String kind = row.getString(KIND);
      switch (kind) {
        case "START":
          {
            starts++;
            startedMs = Order.min(startedMs, ts);
            if (firstStart == null) {
              firstStart = row;
            }
            Long timeout = (Long) row.get(TIMEOUT_MS);
            long lease = timeout != null && timeout > 0 ? timeout : defaultTimeoutMs;
            deadlineMs = ts == null ? null : ts + lease;
            break;
          }
        case "EXTEND":
          {
            extendsCount++;
            Long timeout = (Long) row.get(TIMEOUT_MS);
            if (timeout != null) {
              deadlineMs = ts == null ? null : ts + timeout;
            }
            break;
          }
        case "ACK":
        case "REJECT":
          if (outcome == null) {
            outcome = row;
          }
          break;
        case "DELAY":
          {
            Boolean deferred = (Boolean) row.get(DEFERRED);
            if (Boolean.FALSE.equals(deferred) && outcome == null) {
              outcome = row;
            } else if (Boolean.TRUE.equals(deferred) && !deferredSeen) {
              deferredSeen = true;
              Long delay = (Long) row.get(DELAY_MS);
              deferredDueMs = ts == null || delay == null ? null : ts + delay;
            }
            break;
          }
        default:
          break;
      }
    }

    String outcomeKind() {
      return outcome == null ? null : outcome.getString(KIND);
    }

    /** The outcome's reason (an empty one is none), as the SQL fold's ``outcome.reason``. */
    String outcomeReason() {
      if (outcome == null) {
        return null;
      }
      String reason = (String) outcome.get(REASON);
      return reason == null || reason.isEmpty() ? null : reason;
    }

    Long processingMs() {
      if (outcome == null || startedMs == null || outcome.get(TS) == null) {
        return null;
      }
      return (Long) outcome.get(TS) - startedMs;
    }

    /** The delay the consumer asked for (a retry not left to the policy). */
    Long requestedDelayMs() {
      if (outcome != null
          && "DELAY".equals(outcomeKind())
          && Boolean.FALSE.equals(outcome.get(POLICY_DELAY))) {
        return (Long) outcome.get(DELAY_MS);
      }
      return null;
    }

    /** The history element: the SQL fold's ``info`` struct, an open attempt ``timedOut``
     * when a later one exists. */
    Row info(boolean timedOut) {
      Row record = firstStart != null ? firstStart : firstRow;
      String kind = outcomeKind();
      String consumer = firstStart == null ? null : (String) firstStart.get(CONSUMER);
      String label; // an outcome is an ACK, a DELAY or a REJECT (see add)
      if (kind == null) {
        label = timedOut ? "timed_out" : "open";
      } else {
        label =
            switch (kind) {
              case "ACK" -> "acked";
              case "DELAY" -> "retried";
              default -> "rejected";
            };
      }
      boolean retried = "DELAY".equals(kind);
      return RowFactory.create(
          number,
          record.get(TOPIC),
          record.get(PARTITION),
          record.get(OFFSET),
          consumer == null || consumer.isEmpty() ? null : consumer,
          instant(startedMs),
          instant(deadlineMs),
          starts,
          extendsCount,
          label,
          outcome == null ? null : instant((Long) outcome.get(TS)),
          processingMs(),
          requestedDelayMs(),
          retried && Boolean.TRUE.equals(outcome.get(POLICY_DELAY)),
          retried || "REJECT".equals(kind) ? outcomeReason() : null,
          instant(deferredDueMs));
    }
  }

  private static Instant instant(Long millis) {
    return millis == null ? null : Instant.ofEpochMilli(millis);
  }

  /** Spark's rules: aggregates skip nulls; ascending orders put nulls first. */
  private static final class Order {
    private Order() {}

    static <T extends Comparable<T>> T min(T a, T b) {
      if (a == null) {
        return b;
      }
      return b == null || a.compareTo(b) <= 0 ? a : b;
    }

    static <T extends Comparable<T>> T max(T a, T b) {
      if (a == null) {
        return b;
      }
      return b == null || a.compareTo(b) >= 0 ? a : b;
    }

    static Long sum(Long a, Long b) {
      if (a == null) {
        return b;
      }
      return b == null ? a : Long.valueOf(a + b);
    }

    /** Rows of comparable values, field by field, nulls first (Spark's struct order). */
    static int compareRows(Row a, Row b) {
      for (int i = 0; i < a.length(); i++) {
        int c = compare(a.get(i), b.get(i));
        if (c != 0) {
          return c;
        }
      }
      return 0;
    }

    @SuppressWarnings("unchecked")
    private static int compare(Object a, Object b) {
      if (a == null || b == null) {
        return a == null ? (b == null ? 0 : -1) : 1;
      }
      if (a instanceof String) {
        return compareUtf8((String) a, (String) b);
      }
      return ((Comparable<Object>) a).compareTo(b);
    }

    /** Strings in the order of their UTF-8 bytes, as Spark compares them (code points). */
    private static int compareUtf8(String a, String b) {
      int i = 0;
      int j = 0;
      while (i < a.length() && j < b.length()) {
        int ca = a.codePointAt(i);
        int cb = b.codePointAt(j);
        if (ca != cb) {
          return Integer.compare(ca, cb);
        }
        i += Character.charCount(ca);
        j += Character.charCount(cb);
      }
      return Boolean.compare(i < a.length(), j < b.length());
    }
  }
}
